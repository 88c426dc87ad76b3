"""A one-row decode step's projections as Triton GEMVs that carry the ops between them.

At batch 1 a Llama layer is four weight-bound GEMMs with small kernels between them: the
residual add + RMSNorm before qkv, the add + norm before gate_up, SiLU * up before down. Each
small kernel is a few microseconds of latency during which HBM idles. Here each projection is
one kernel, y = W x, that computes its own input and output:

- prologue `norm`: x = rmsnorm(src [+ h]) * w, each program summing the row's squares itself
  (the row is a few KiB, read from the L2), then normalizing the chunks of x as it streams W;
- prologue `silu`: x = silu(gate) * up, from the gate_up projection's output;
- epilogue `into`: out = out [+ h] + y, in place: the residual stream's adds. Each program
  owns its output rows, so the add of the row it writes reads nothing another program writes.

A layer is then qkv(norm(residual + h)) -> attention -> residual += h + o(.) ->
gate_up(norm(residual)) -> h = down(silu(.)): four kernels and the attention, where eight ran.
Numerics as the unfused chain's: sums in fp32; the normalized row, the activation, each
projection's output and each add rounded to the model's dtype where that chain rounds them.

An FP8 linear (E4M3 weight, a float32 scale a row: models.layers.fp8_linear) runs the same
programs: its weight loads convert E4M3 in registers, half the bytes of bf16 streamed, and each
row's sum is multiplied by its scale before the bias (`SCALE`).

Runs under Triton's interpreter too (the CPU tests; it loads E4M3 exactly).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from models.kernels.triton_ops import _pow2, fp8_row_scale, interpreting


@dataclass(frozen=True)
class GemvConfig:
    """A GEMV's tiling: output rows a program, columns a loop step, warps, and the loop's
    unrolling (the loads of that many steps issued together: more bytes in flight a thread);
    one_pass: a norm before the GEMV read in the GEMV's own loop, its 1 / rms scaling the sums
    after it (as the small GEMMs do), instead of a first pass over the row a program."""

    # the best uniform tiling of Llama-3.1-8B's four projections on the H100 (docs/BENCHMARKS.md)
    block_n: int = 2
    block_k: int = 2048
    warps: int = 4
    unroll: int = 2
    one_pass: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GEMV {name} {v}: a power of 2")
        if self.warps not in (1, 2, 4, 8, 16) or self.unroll < 1:
            raise ValueError(f"GEMV warps {self.warps} (1..16, a power of 2), unroll {self.unroll}")
        if self.one_pass not in (False, True):
            raise ValueError(f"GEMV one_pass {self.one_pass!r}: 0 or 1")

    @classmethod
    def parse(cls, text: str) -> GemvConfig:
        """'BN:BK:WARPS:UNROLL[:ONE_PASS]' (or a prefix of it; the rest default)."""
        parts = [int(p) for p in text.replace(",", ":").split(":") if p]
        if len(parts) > 5:
            raise ValueError(f"GEMV config {text!r}: at most BN:BK:WARPS:UNROLL:ONE_PASS")
        return cls(*parts)

    def __str__(self) -> str:
        one_pass = ":1" if self.one_pass else ""
        return f"{self.block_n}:{self.block_k}:{self.warps}:{self.unroll}{one_pass}"


PRO_NONE, PRO_NORM, PRO_SILU = 0, 1, 2
# E4M3 values an FP8 weight's load reads (16: 16 bytes a load, the widest; 8: a thread's weight
# values in the layout of its 8 bf16 of x, so x needs no pass through shared memory a loop
# step). Being measured: bench_kernels.py gemv --fp8 times the chain under both.
FP8_LOAD = 16


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "eps"])
    def gemv_kernel(
        w_ptr, x_ptr, h_ptr, nw_ptr, b_ptr, s_ptr, out_ptr, n, eps,
        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRO: tl.constexpr, INTO: tl.constexpr, HAS_H: tl.constexpr, BIAS: tl.constexpr,
        UNROLL: tl.constexpr, GLU: tl.constexpr, SCALE: tl.constexpr, ONE_PASS: tl.constexpr,
        WVEC: tl.constexpr,
    ):  # fmt: skip
        # program i: out[rows] (op)= W[rows, :] @ x, rows = i * BLOCK_N + [0, BLOCK_N); with GLU
        # (W: gate rows, then n up rows), out[i * BLOCK_N / 2 + j] = silu(gate_j) * up_j, the
        # program's rows interleaved gate, up, gate, up ..
        pid = tl.program_id(0)
        jj = tl.arange(0, BLOCK_N)
        if GLU:
            orows = pid * (BLOCK_N // 2) + jj // 2
            rows = orows + (jj % 2) * n
            rm = orows < n
        else:
            rows = pid * BLOCK_N + jj
            rm = rows < n
        dt = out_ptr.dtype.element_ty
        kk0 = tl.arange(0, BLOCK_K)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)  # the norm's: the row's squares, summed
        if PRO == 1 and not ONE_PASS:  # the row's sum of squares, of src (+ h) in fp32
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + kk0
                km = kk < K
                s = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
                if HAS_H:
                    s += tl.load(h_ptr + kk, mask=km, other=0.0).to(tl.float32)
                sq += s * s
            inv = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
            kk = k0 + kk0
            km = kk < K
            if PRO == 1:
                s = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
                if HAS_H:
                    s += tl.load(h_ptr + kk, mask=km, other=0.0).to(tl.float32)
                nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
                if ONE_PASS:  # the row scaled by the norm's weight; 1 / rms after the sums
                    sq += s * s
                    xv = (s * nw).to(dt).to(tl.float32)
                else:
                    xv = (s * inv * nw).to(dt).to(tl.float32)
            elif PRO == 2:
                g = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + kk, mask=km, other=0.0).to(tl.float32)
                xv = (g / (1.0 + tl.exp(-g)) * u).to(dt).to(tl.float32)
            else:
                xv = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            wm = rm[:, None] & km[None, :]
            # W is read once a step: the first lines the L2 evicts (the rows of x stay)
            if WVEC:  # the weight's loads WVEC values wide (a thread's x values' layout)
                kw = k0 + (kk0 // WVEC) * WVEC + kk0 % WVEC
                w_at = w_ptr + rows[:, None].to(tl.int64) * K + kw[None, :]
            else:
                w_at = w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
            w = tl.load(w_at, mask=wm, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, 1)
        if PRO == 1 and ONE_PASS:
            y *= 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
        if SCALE:  # an FP8 weight's rows: their scales
            y *= tl.load(s_ptr + rows, mask=rm, other=0.0)
        if BIAS:
            y += tl.load(b_ptr + rows, mask=rm, other=0.0).to(tl.float32)
        y = y.to(dt)
        if GLU:  # rounded as the unfused chain: gate_up's outputs, then the activation
            g, u = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_N // 2, 2)))
            act = (g / (1.0 + tl.exp(-g)) * u).to(dt)
            orow = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + orow, act, mask=orow < n)
        else:
            if INTO:  # the residual stream: out (+ h) + y, each add rounded as the unfused chain's
                r = tl.load(out_ptr + rows, mask=rm, other=0.0)
                if HAS_H:
                    r = r.to(tl.float32) + tl.load(h_ptr + rows, mask=rm, other=0.0).to(tl.float32)
                    r = r.to(dt)
                y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
            tl.store(out_ptr + rows, y, mask=rm)

    return gemv_kernel


def gemv(
    linear: torch.nn.Linear,
    x: torch.Tensor,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    silu: bool = False,
    h: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
    glu: bool = False,
    config: GemvConfig = GemvConfig(),
) -> torch.Tensor:
    """linear(x) for one row x [1, K] (or [1, 2K] with silu), with the ops beside it (linear:
    an nn.Linear of x's dtype, or an FP8 linear of that compute dtype, `fp8_row_scale`):

    - norm=(weight, eps): linear(rmsnorm(x + h) * weight) (h: [1, K] or None);
    - silu: linear(silu(x[:, :K]) * x[:, K:]);
    - into: into (+ h) + linear(x), written into `into` [1, N] and returned;
    - glu (linear: gate rows, then up rows; config.block_n >= 2): silu(gate) * up of linear(x),
      [1, N / 2], the activation the next GEMV then reads as it is.

    h joins the norm's input, or with `into`, the residual's add (not both)."""
    w = linear.weight
    n, k = w.shape
    assert x.shape[0] == 1 and x.is_contiguous() and w.stride() == (k, 1)
    assert x.shape[1] == (2 * k if silu else k) and not (norm is not None and silu)
    assert h is None or (h.is_contiguous() and h.numel() == (n if into is not None else k))
    assert into is None or (into.is_contiguous() and into.numel() == n)
    assert into is None or norm is None or h is None
    assert not glu or (into is None and n % 2 == 0 and config.block_n >= 2)
    if glu:
        n //= 2  # the outputs: one a gate row and its up row
    out = into if into is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (x, 0.0)
    bias, scale = linear.bias, fp8_row_scale(linear)
    c = config
    block_k = min(c.block_k, _pow2(k))
    pro = PRO_NORM if norm is not None else PRO_SILU if silu else PRO_NONE
    outputs_a_program = c.block_n // 2 if glu else c.block_n
    _build(interpreting())[(-(-n // outputs_a_program),)](
        w, x, h if h is not None else x, nw, bias if bias is not None else w,
        scale if scale is not None else w, out, n, float(eps),
        K=k, BLOCK_N=c.block_n, BLOCK_K=block_k, PRO=pro, INTO=into is not None,
        HAS_H=h is not None, BIAS=bias is not None,
        UNROLL=c.unroll, GLU=glu, SCALE=scale is not None, ONE_PASS=c.one_pass,
        WVEC=FP8_LOAD if scale is not None and FP8_LOAD < 16 else 0,
        num_warps=c.warps, num_stages=1,
    )  # fmt: skip
    return out


def gemv_reference(
    linear: torch.nn.Linear,
    x: torch.Tensor,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    silu: bool = False,
    h: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """gemv's result through torch ops, rounded where the unfused chain rounds (the tests'); also
    small_gemm's (models.kernels.triton_small_gemm), x [M, K]."""
    dt = x.dtype
    if norm is not None:
        s = x.float() + (h.float() if h is not None else 0.0)
        weight, eps = norm
        x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dt)
    elif silu:
        g, u = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(g) * u).to(dt)
    y = linear_reference(linear, x)
    if glu:
        g, u = y.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(dt)
    if into is None:
        return y
    rows = x.shape[0]
    r = into.reshape(rows, -1)
    if h is not None:
        r = (r.float() + h.reshape(rows, -1).float()).to(dt)
    into.copy_((r.float() + y.float()).to(dt).reshape(into.shape))
    return into


def linear_reference(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) through torch ops: nn.Linear's, or an FP8 linear's sums in fp32 over its
    dequantized weight, scaled by row, the bias added, rounded once to x's dtype."""
    scale = fp8_row_scale(linear)
    if scale is None:
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    y = torch.nn.functional.linear(x.float(), linear.weight.float()) * scale
    if linear.bias is not None:
        y = y + linear.bias.float()
    return y.to(x.dtype)
