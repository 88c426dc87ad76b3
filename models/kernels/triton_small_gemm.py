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

A projection can also carry the ops between a layer's GEMMs, so that a few-row layer is four
kernels and the attention, where eight ran (as the one-row GEMVs, models.kernels.triton_gemv):

- the residual add after it (`into`): each program adds its outputs into the stream's columns
  it owns; with the next norm's weight it also writes those columns scaled by that weight and
  the sums of their squares, a row's sum in parts (`Normed`);
- the RMSNorm before it: given a `Normed`, the loop is the plain one over the scaled rows, and
  1 / rms of each row, from the parts, scales the sums after it. So no program normalizes x
  in its loop: work on x there (a norm's every program, at every step of K) cost more than the
  norm's own kernel (docs/BENCHMARKS.md);
- SiLU * up of its outputs (`glu`): a program's rows of W gate and up rows by turns, the pairs
  split after the loop.

Numerics: x times the norm's weight is rounded to the model's dtype before the products, where
the unfused chain rounds the normalized row (a rounding at another scale: the same error
bound); everything else is rounded where the chain rounds it.

An FP8 linear (E4M3 weight, a float32 scale a row) runs the same programs: each tile of W is
converted to x's dtype in registers before its product (the weight's bytes halved; the sums as
for a bf16 weight of those values) and the sums are scaled by row before the bias (`SCALE`).

Runs under Triton's interpreter too (the CPU tests), its products in fp32 there (the
interpreter has no bf16 arithmetic), as for fp32 weights anywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from models.kernels.triton_ops import _pow2, fp8_row_scale, interpreting

MAX_ROWS = 16  # the rows of x a launch takes (tl.dot's smallest tile)


@dataclass(frozen=True)
class SmallGemmConfig:
    """A small GEMM's tiling: weight rows a program, columns a loop step, warps, and the loop's
    software pipelining depth (the tiles of W in flight a program); `wide`: the tiling of the
    projections of WIDE_OUTPUTS outputs and more (None: this one's, or WIDE for the default)."""

    # the tiling that led for Llama-3.1-8B's narrow projections at 16 rows on the H100
    # (docs/BENCHMARKS.md); as the default, it gives way to WIDE for wide ones (`for_outputs`)
    block_n: int = 16
    block_k: int = 128
    warps: int = 4
    stages: int = 6
    wide: SmallGemmConfig | None = None

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"small GEMM {name} {v}: a power of 2 from 16")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1:
            raise ValueError(
                f"small GEMM warps {self.warps} (1..16, a power of 2), stages {self.stages}"
            )
        if self.wide is not None and self.wide.wide is not None:
            raise ValueError("small GEMM: a wide tiling has no wide tiling of its own")

    @classmethod
    def parse(cls, text: str) -> SmallGemmConfig:
        """'BN:BK:WARPS:STAGES' (or a prefix of it; the rest default), optionally followed by
        '/BN:BK:WARPS:STAGES', the wide projections' tiling; '' the default."""
        if not text:
            return cls()
        narrow, sep, wide = text.partition("/")
        tilings = []
        for part in (narrow, wide) if sep else (narrow,):
            try:
                ints = [int(p) for p in part.replace(",", ":").split(":") if p]
            except ValueError:
                ints = []
            if not ints or len(ints) > 4:
                raise ValueError(
                    f"small GEMM config {text!r}: BN:BK:WARPS:STAGES[/BN:BK:WARPS:STAGES]"
                )
            tilings.append(ints)
        return cls(*tilings[0], wide=cls(*tilings[1]) if sep else None)

    def __str__(self) -> str:
        wide = f"/{self.wide}" if self.wide is not None else ""
        return f"{self.block_n}:{self.block_k}:{self.warps}:{self.stages}{wide}"

    def for_outputs(self, n: int) -> SmallGemmConfig:
        """The tiling for a projection of n outputs: the default one takes WIDE from
        WIDE_OUTPUTS outputs (enough programs of 64 rows to fill the GPU, each reading x
        fewer times); any other applies as it is, but for a `wide` one's."""
        if n < WIDE_OUTPUTS:
            return self
        if self.wide is not None:
            return self.wide
        return WIDE if self == SmallGemmConfig() else self


# gate_up's tiling (28672 outputs) under the default: at 16 rows on the H100, 81.9 us against
# the narrow tiling's 86.8 and cuBLAS's 83.1
WIDE = SmallGemmConfig(64, 128, 4, 4)
WIDE_OUTPUTS = 16384


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["m", "n", "parts", "eps"])
    def small_gemm_kernel(
        x_ptr, w_ptr, b_ptr, s_ptr, out_ptr, sq_ptr, nw_ptr, xs_ptr, sq_out_ptr,
        m, n, sx, so, sxs, parts, eps,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, BIAS: tl.constexpr, DOT_F32: tl.constexpr, PRE: tl.constexpr,
        INTO: tl.constexpr, NEXT: tl.constexpr, GLU: tl.constexpr, PARTS_BLOCK: tl.constexpr,
        SCALE: tl.constexpr,
    ):  # fmt: skip
        # program i: out[:m, cols] = x[:m] @ W[cols]^T, cols = i * BLOCK_N + [0, BLOCK_N); with
        # GLU, out[:m, cols] = silu(x W[cols]^T) * (x W[n + cols]^T), cols = i * BLOCK_N / 2 +
        # [0, BLOCK_N / 2), the program's rows of W interleaved gate, up, gate, up ..
        pid = tl.program_id(0)
        jj = tl.arange(0, BLOCK_N)
        if GLU:
            rows = pid * (BLOCK_N // 2) + jj // 2
            cm = rows < n
            rows += (jj % 2) * n
        else:
            rows = pid * BLOCK_N + jj
            cm = rows < n
        r = tl.arange(0, BLOCK_M)
        rmask = r < m
        kk0 = tl.arange(0, BLOCK_K)
        dt = out_ptr.dtype.element_ty
        w_rows = w_ptr + rows[:, None].to(tl.int64) * K
        x_rows = x_ptr + r[None, :] * sx
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
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
            if DOT_F32:  # the interpreter: no bf16 arithmetic, exact fp32 products
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            elif SCALE:  # E4M3 -> x's dtype: exact
                acc = tl.dot(w.to(xt.dtype), xt, acc)
            else:
                acc = tl.dot(w, xt, acc)
        if PRE:  # x: rows scaled by the norm's weight; 1 / rms of each from its parts' squares
            pp0 = tl.arange(0, PARTS_BLOCK)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            for p0 in range(0, parts, PARTS_BLOCK):
                pp = p0 + pp0
                part = tl.load(sq_ptr + pp[:, None] * BLOCK_M + r[None, :],
                               mask=(pp < parts)[:, None], other=0.0)  # fmt: skip
                total += tl.sum(part, 0)
            inv = 1.0 / tl.sqrt(total / K + eps)
            acc = acc * inv[None, :]
        if SCALE:  # an FP8 weight's rows: their scales
            acc = acc * tl.load(s_ptr + rows, mask=cm, other=0.0)[:, None]
        if BIAS:
            acc += tl.load(b_ptr + rows, mask=cm, other=0.0).to(tl.float32)[:, None]
        y = acc.to(dt)
        if GLU:  # rounded as the unfused chain: gate_up's outputs, then the activation
            pair = tl.permute(tl.reshape(y.to(tl.float32), (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1))
            g, u = tl.split(pair)  # [BLOCK_N / 2, BLOCK_M] each
            y = (g / (1.0 + tl.exp(-g)) * u).to(dt)
            cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            cm = cols < n
        else:
            cols = rows
        at = out_ptr + r[None, :] * so + cols[:, None]
        om = cm[:, None] & rmask[None, :]
        if INTO:  # the residual stream: out + y, rounded as the unfused chain's add
            y = (tl.load(at, mask=om, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
            if NEXT:  # the next norm's input: these columns scaled, their squares summed
                yf = tl.where(om, y.to(tl.float32), 0.0)
                nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                tl.store(xs_ptr + r[None, :] * sxs + cols[:, None], (yf * nw[:, None]).to(dt),
                         mask=om)  # fmt: skip
                tl.store(sq_out_ptr + pid * BLOCK_M + r, tl.sum(yf * yf, 0))
        tl.store(at, y, mask=om)

    @triton.jit(do_not_specialize=["m", "n"])
    def prenorm_kernel(
        x_ptr, nw_ptr, xs_ptr, sq_ptr, m, n, sx, sxs,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # program i: x[:m, cols] scaled by the norm's weight, and the sums of their squares
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_M)
        om = (cols < n)[:, None] & (r < m)[None, :]
        x = tl.load(x_ptr + r[None, :] * sx + cols[:, None], mask=om, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        dt = xs_ptr.dtype.element_ty
        tl.store(xs_ptr + r[None, :] * sxs + cols[:, None], (x * nw[:, None]).to(dt), mask=om)
        tl.store(sq_ptr + pid * BLOCK_M + r, tl.sum(x * x, 0))

    return small_gemm_kernel, prenorm_kernel


@dataclass(frozen=True)
class Normed:
    """An RMSNorm's input for a small GEMM: the rows of x scaled by the norm's weight (rounded
    to x's dtype), and the sums of squares of x's rows in parts, [parts, MAX_ROWS] fp32 (a
    row's sum: the sum of its column). The GEMM applies 1 / rms to its sums."""

    rows: torch.Tensor
    squares: torch.Tensor
    eps: float


PRENORM_BLOCK = 256  # columns a program of prenorm
PARTS_BLOCK = 64  # parts a step of the GEMM's sum over them


def prenorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Normed:
    """x [M, K] (M <= MAX_ROWS, unit column stride) as a norm's input for small_gemm: one
    kernel (the first layer's; later ones come out of the residual's add, small_gemm's
    `into`)."""
    m, k = x.shape
    assert 1 <= m <= MAX_ROWS and x.stride(1) == 1 and weight.shape == (k,)
    parts = -(-k // PRENORM_BLOCK)
    rows = torch.empty(m, k, dtype=x.dtype, device=x.device)
    squares = torch.empty(parts, MAX_ROWS, dtype=torch.float32, device=x.device)
    _build(interpreting())[1][(parts,)](
        x, weight, rows, squares, m, k, x.stride(0), rows.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=PRENORM_BLOCK,
    )  # fmt: skip
    return Normed(rows, squares, eps)


def fits(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether small_gemm takes linear(x): a linear whose forward is nn.Linear's (a subclass
    that computes something else keeps its own) of a weight of x's dtype, or an FP8 linear
    (`fp8_row_scale`) of x's compute dtype; its weight row-major, x [M, K] with 1 <= M <=
    MAX_ROWS and unit column stride."""
    w = getattr(linear, "weight", None)
    plain = (
        isinstance(linear, torch.nn.Linear)
        and type(linear).forward is torch.nn.Linear.forward
        and isinstance(w, torch.Tensor)
        and w.dtype == x.dtype
    )
    fp8 = fp8_row_scale(linear) is not None and getattr(linear, "compute_dtype", None) == x.dtype
    return (
        (plain or fp8)
        and w.dim() == 2
        and w.stride(1) == 1
        and w.stride(0) == w.shape[1]
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
    )


def small_gemm(
    linear: torch.nn.Linear,
    x: torch.Tensor | Normed,
    config: SmallGemmConfig = SmallGemmConfig(),
    *,
    into: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    glu: bool = False,
) -> torch.Tensor | Normed:
    """linear(x) for x [M, K], M <= MAX_ROWS (`fits`) -> [M, N], with the ops beside it:

    - x a Normed (`prenorm`, or a residual add's with `norm`): linear(rmsnorm(x) * weight);
    - into: into + linear(x), written into `into` [M, N] and returned; with norm=(weight, eps),
      the Normed of the new `into` for the next norm is returned instead;
    - glu (linear: gate rows, then up rows): silu(gate) * up of linear(x), [M, N / 2]."""
    normed = x if isinstance(x, Normed) else None
    x = normed.rows if normed is not None else x
    assert fits(linear, x), "small_gemm takes a row-major linear and at most 16 rows"
    w, bias, scale = linear.weight, linear.bias, fp8_row_scale(linear)
    n, k = w.shape
    m = x.shape[0]
    assert into is None or (into.stride(1) == 1 and into.shape == (m, n) and not glu)
    assert norm is None or into is not None, "a norm's input comes out of a residual add"
    assert not glu or n % 2 == 0
    c = config.for_outputs(n)
    block_n = c.block_n  # rows of W a program; with glu, half of them gate rows
    if glu:
        n //= 2
    grid = -(-n // (block_n // 2 if glu else block_n))
    out = into if into is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    sq = normed.squares if normed is not None else x
    nxt = None
    if norm is not None:  # the next norm's input: scaled rows, squares a program
        nxt = Normed(
            torch.empty(m, n, dtype=x.dtype, device=x.device),
            torch.empty(grid, MAX_ROWS, dtype=torch.float32, device=x.device),
            norm[1],
        )
    nw = norm[0] if norm is not None else x
    block_k = min(c.block_k, max(16, _pow2(k)))
    _build(interpreting())[0][(grid,)](
        x, w, bias if bias is not None else w, scale if scale is not None else w, out, sq, nw,
        nxt.rows if nxt is not None else x, nxt.squares if nxt is not None else sq,
        m, n, x.stride(0), out.stride(0), nxt.rows.stride(0) if nxt is not None else 0,
        sq.shape[0] if normed is not None else 0, normed.eps if normed is not None else 0.0,
        K=k, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        BIAS=bias is not None, DOT_F32=interpreting() or x.dtype == torch.float32,
        PRE=normed is not None, INTO=into is not None, NEXT=nxt is not None, GLU=glu,
        PARTS_BLOCK=PARTS_BLOCK, SCALE=scale is not None, num_warps=c.warps,
        num_stages=c.stages,
    )  # fmt: skip
    return nxt if nxt is not None else out


def small_gemm_reference(
    linear: torch.nn.Linear,
    x: torch.Tensor,
    *,
    pre: tuple[torch.Tensor, float] | None = None,
    into: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    glu: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """small_gemm's result through torch ops, rounded where the kernel rounds (the tests'):
    pre=(weight, eps) for small_gemm(prenorm(x, weight, eps)); with `into` and `norm`, (the
    new `into`, the next norm's scaled rows) (the squares' sums: of the new `into`'s rows)."""
    dt = x.dtype
    inv = 1.0
    if pre is not None:
        weight, eps = pre
        inv = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x = (x.float() * weight.float()).to(dt)
    y = torch.nn.functional.linear(x.float(), linear.weight.float()) * inv
    scale = fp8_row_scale(linear)
    if scale is not None:
        y = y * scale
    if linear.bias is not None:
        y = y + linear.bias.float()
    y = y.to(dt)
    if glu:
        g, u = y.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(dt)
    if into is None:
        return y
    into.copy_((into.float() + y.float()).to(dt))
    if norm is None:
        return into
    return into, (into.float() * norm[0].float()).to(dt)
