"""A small batch's projections, y = x W^T for a few rows x, as one Triton GEMM each.

A decode step of a few sequences multiplies a handful of rows by each weight: the GEMM is as
weight-bound as batch 1's GEMV (each weight element read once, used a few times), but on the
tensor cores. cuBLAS picks split-K tilings for some of these shapes, then a reduce kernel
after them. Here each program owns BLOCK_N output columns (weight rows) over the whole of K,
streams its rows of W once (`stages` tiles in flight, fetched asynchronously into shared
memory) and multiplies them by the rows of x (at most BLOCK_M, padded) on the tensor cores:
W's tile [BLOCK_N, BLOCK_K] times x's transposed [BLOCK_K, BLOCK_M], fp32 sums, one kernel a
projection. Every program reads all of x (from the L2): a wider BLOCK_N reads it fewer times
but leaves fewer programs to spread the weight's bytes over the SMs.

Like the one-row GEMVs (models.layers.triton_gemv), a projection can carry the ops between a
layer's GEMMs: the add + RMSNorm before it, the residual add after it, SiLU * up of its outputs.
A few-row layer is then four kernels and the attention, where eight ran.

Runs under Triton's interpreter too (the CPU tests), its products in fp32 there (the
interpreter has no bf16 arithmetic), as for fp32 weights anywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from models.attention.triton_ops import _pow2, interpreting

MAX_ROWS = 16  # the rows of x a launch takes (tl.dot's smallest tile)


@dataclass(frozen=True)
class SmallGemmConfig:
    """A small GEMM's tiling: weight rows a program, columns a loop step, warps, and the loop's
    software pipelining depth (the tiles of W in flight a program)."""

    # the tiling that led for Llama-3.1-8B's narrow projections at 16 rows on the H100
    # (docs/BENCHMARKS.md); as the default, it gives way to WIDE for wide ones (`for_outputs`)
    block_n: int = 16
    block_k: int = 128
    warps: int = 4
    stages: int = 6

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"small GEMM {name} {v}: a power of 2 from 16")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1:
            raise ValueError(
                f"small GEMM warps {self.warps} (1..16, a power of 2), stages {self.stages}"
            )

    @classmethod
    def parse(cls, text: str) -> SmallGemmConfig:
        """'BN:BK:WARPS:STAGES' (or a prefix of it; the rest default)."""
        parts = [int(p) for p in text.replace(",", ":").split(":") if p]
        if len(parts) > 4:
            raise ValueError(f"small GEMM config {text!r}: at most BN:BK:WARPS:STAGES")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.block_n}:{self.block_k}:{self.warps}:{self.stages}"

    def for_outputs(self, n: int) -> SmallGemmConfig:
        """The tiling for a projection of n outputs: the default one takes WIDE from
        WIDE_OUTPUTS outputs (enough programs of 64 rows to fill the GPU, each reading x
        fewer times); any other applies as it is."""
        return WIDE if n >= WIDE_OUTPUTS and self == SmallGemmConfig() else self


# gate_up's tiling (28672 outputs) under the default: at 16 rows on the H100, 81.9 us against
# the narrow tiling's 86.8 and cuBLAS's 83.1
WIDE = SmallGemmConfig(64, 128, 4, 4)
WIDE_OUTPUTS = 16384


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["m", "n", "eps"])
    def small_gemm_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, h_ptr, nw_ptr, m, n, sx, so, sh, eps,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, BIAS: tl.constexpr, DOT_F32: tl.constexpr,
        NORM: tl.constexpr, HAS_H: tl.constexpr, INTO: tl.constexpr, GLU: tl.constexpr,
    ):  # fmt: skip
        # program i: out[:m, cols] = x[:m] @ W[cols]^T, cols = i * BLOCK_N + [0, BLOCK_N); with
        # GLU, out[:m, cols] = silu(x W[cols]^T) * (x W[n + cols]^T), BLOCK_N gate rows and as
        # many up rows a program
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < n
        r = tl.arange(0, BLOCK_M)
        rmask = r < m
        kk0 = tl.arange(0, BLOCK_K)
        dt = out_ptr.dtype.element_ty
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        x_rows = x_ptr + r[None, :] * sx
        h_rows = h_ptr + r[None, :] * sh
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + kk0
            if EVEN_K:
                wm, xm = cm[:, None], rmask[None, :]
            else:
                wm, xm = cm[:, None] & (kk < K)[None, :], rmask[None, :] & (kk < K)[:, None]
            # W is read once a step: the first lines the L2 evicts (x stays), where the load
            # is not an asynchronous copy (one stage)
            w = tl.load(w_rows + kk[None, :], mask=wm, other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_rows + kk[:, None], mask=xm, other=0.0)  # [BLOCK_K, BLOCK_M]
            if NORM:  # x (+ h) scaled by the norm's weight; by 1 / rms(x (+ h)) after the sums
                s = xt.to(tl.float32)
                if HAS_H:
                    s += tl.load(h_rows + kk[:, None], mask=xm, other=0.0).to(tl.float32)
                sq += tl.sum(s * s, 0)
                nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                xt = s * nw[:, None]
                if not DOT_F32:
                    xt = xt.to(dt)
            if DOT_F32:  # the interpreter: no bf16 arithmetic, exact fp32 products
                xt = xt.to(tl.float32)
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
            if GLU:
                up = w_rows + n.to(tl.int64) * K + kk[None, :]
                u = tl.load(up, mask=wm, other=0.0, eviction_policy="evict_first")
                if DOT_F32:
                    acc_up = tl.dot(u.to(tl.float32), xt, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(u, xt, acc_up)
        if NORM:
            inv = 1.0 / tl.sqrt(sq / K + eps)
            acc = acc * inv[None, :]
            acc_up = acc_up * inv[None, :]
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[:, None]
            if GLU:
                acc_up += tl.load(b_ptr + n + cols, mask=cm, other=0.0).to(tl.float32)[:, None]
        y = acc.to(dt)
        if GLU:  # rounded as the unfused chain: gate_up's outputs, then the activation
            g = y.to(tl.float32)
            u = acc_up.to(dt).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g)) * u).to(dt)
        at = out_ptr + r[None, :] * so + cols[:, None]
        om = cm[:, None] & rmask[None, :]
        if INTO:  # the residual stream: out (+ h) + y, each add rounded as the unfused chain's
            s = tl.load(at, mask=om, other=0.0)
            if HAS_H:
                hc = tl.load(h_ptr + r[None, :] * sh + cols[:, None], mask=om, other=0.0)
                s = (s.to(tl.float32) + hc.to(tl.float32)).to(dt)
            y = (s.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(at, y, mask=om)

    return small_gemm_kernel


def fits(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether small_gemm takes linear(x): a linear whose forward is nn.Linear's (a subclass
    that computes something else keeps its own), a row-major weight of x's dtype, x [M, K] with
    1 <= M <= MAX_ROWS and unit column stride."""
    w = getattr(linear, "weight", None)
    return (
        isinstance(linear, torch.nn.Linear)
        and type(linear).forward is torch.nn.Linear.forward
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.dtype == x.dtype
        and w.stride(1) == 1
        and w.stride(0) == w.shape[1]
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
    )


def small_gemm(
    linear: torch.nn.Linear,
    x: torch.Tensor,
    config: SmallGemmConfig = SmallGemmConfig(),
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    h: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """linear(x) for x [M, K], M <= MAX_ROWS (`fits`) -> [M, N], with the ops beside it (as
    models.layers.triton_gemv's, for a few rows):

    - norm=(weight, eps): linear(rmsnorm(x + h) * weight) (h: [M, K] or None). The row's
      1 / rms is a factor of each output: applied to the sums, so that x is read once (with
      the weight's scale, x is rounded to the model's dtype before the products, as the
      unfused chain rounds the normalized row);
    - into: into (+ h) + linear(x), written into `into` [M, N] and returned;
    - glu (linear: gate rows, then up rows): silu(gate) * up of linear(x), [M, N / 2].

    h joins the norm's input, or with `into`, the residual's add (not both)."""
    assert fits(linear, x), "small_gemm takes a row-major linear and at most 16 rows"
    w, bias = linear.weight, linear.bias
    n, k = w.shape
    m = x.shape[0]
    assert h is None or (h.stride(1) == 1 and h.shape == (m, n if into is not None else k))
    assert into is None or (into.stride(1) == 1 and into.shape == (m, n) and glu is False)
    assert into is None or norm is None or h is None
    assert not glu or n % 2 == 0
    c = config.for_outputs(n)
    if glu:  # a program's gate rows (at least tl.dot's 16) and as many up rows
        n //= 2
        block_n = max(16, c.block_n // 2)
    else:
        block_n = c.block_n
    out = into if into is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (x, 0.0)
    hh = h if h is not None else x
    block_k = min(c.block_k, max(16, _pow2(k)))
    _build(interpreting())[(-(-n // block_n),)](
        x, w, bias if bias is not None else w, out, hh, nw, m, n,
        x.stride(0), out.stride(0), hh.stride(0), float(eps),
        K=k, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        BIAS=bias is not None, DOT_F32=interpreting() or x.dtype == torch.float32,
        NORM=norm is not None, HAS_H=h is not None, INTO=into is not None, GLU=glu,
        num_warps=c.warps, num_stages=c.stages,
    )  # fmt: skip
    return out
