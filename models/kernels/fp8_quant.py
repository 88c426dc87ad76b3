"""A step's activations quantized to FP8 E4M3 per token in one kernel: each row's amax, its scale
(amax / 448, at least 1e-12 / 448) and the row divided by it, cast to E4M3. torch takes three
passes over the activations for the same (the norm, the float32 quotient written, the cast).
A program holds its whole row in registers (up to MAX_K columns; a loop over wider ones), so a
decode step's few rows are read once, every load of a row issued at once: a program a row is
all the parallelism such a step has.

The numerics are torch's (models.layers.fp8_linear.quantize_rows): the amax exact, the scale the
amax times float32's 1/448 (what torch's CUDA division by a scalar computes), the quotient a
correctly rounded float32 division, the cast to nearest. Runs under
Triton's interpreter too, where the cast is left out (`OUT_F32`: the interpreter's cast to FP8
is wrong on the CPU), so the tests check everything before it; tests/models/hopper_build.py
builds the cast for the GPU.
"""

from __future__ import annotations

import functools

import torch

from models.kernels.triton_ops import _pow2, interpreting

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0, E4M3's largest finite value
MIN_AMAX = 1e-12  # a token's smallest amax (an all-zero row's: its values stay 0)
BLOCK_K = 1024  # columns a loop step, for rows wider than MAX_K
MAX_K = 16384  # the widest row a program holds in registers (32 values a thread in 16 warps)


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["sx", "sq"])
    def quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, sx, sq,
        K: tl.constexpr, BLOCK_K: tl.constexpr, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr,
        OUT_F32: tl.constexpr,
    ):  # fmt: skip
        # program r: row r; in one block of BLOCK_K >= K columns, read once and kept; else read
        # twice (its amax, then its quotient; the second read from L2)
        row = tl.program_id(0).to(tl.int64)
        if BLOCK_K >= K:
            kk = tl.arange(0, BLOCK_K)
            km = kk < K
            v = tl.load(x_ptr + row * sx + kk, mask=km, other=0.0).to(tl.float32)
            s = tl.maximum(tl.max(tl.abs(v), 0), MIN_AMAX) * (1.0 / FP8_MAX)
            tl.store(s_ptr + row, s)
            v = tl.math.div_rn(v, s)  # |v| <= 448: no saturation needed
            if OUT_F32:
                tl.store(q_ptr + row * sq + kk, v, mask=km)
            else:
                tl.store(q_ptr + row * sq + kk, v.to(tl.float8e4nv), mask=km)
        else:
            peak = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(x_ptr + row * sx + kk, mask=kk < K, other=0.0).to(tl.float32)
                peak = tl.maximum(peak, tl.abs(v))
            # (times float32's 1/448: what torch's CUDA division by a scalar computes)
            s = tl.maximum(tl.max(peak, 0), MIN_AMAX) * (1.0 / FP8_MAX)
            tl.store(s_ptr + row, s)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                km = kk < K
                v = tl.load(x_ptr + row * sx + kk, mask=km, other=0.0).to(tl.float32)
                v = tl.math.div_rn(v, s)
                if OUT_F32:
                    tl.store(q_ptr + row * sq + kk, v, mask=km)
                else:
                    tl.store(q_ptr + row * sq + kk, v.to(tl.float8e4nv), mask=km)

    return quantize_rows_kernel


def launch_shape(k: int) -> tuple[int, int]:
    """(BLOCK_K, warps) of rows of k columns: the whole row a block up to MAX_K, in a warp per
    1024 columns (4 to 16), else loop steps of BLOCK_K in 4 warps."""
    block = _pow2(k)
    if block > MAX_K:
        return BLOCK_K, 4
    return block, min(16, max(4, block // 1024))


def quantize_rows(x: torch.Tensor, out_f32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (rows unit-strided) -> (xq [T, K] float8_e4m3fn, scale [T, 1] float32), x ~=
    xq * scale. out_f32: xq before its cast, float32 (the interpreter's tests)."""
    t, k = x.shape
    assert x.stride(1) == 1, "rows must be unit-strided"
    q = torch.empty(t, k, dtype=torch.float32 if out_f32 else FP8_DTYPE, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        block, warps = launch_shape(k)
        _build(interpreting())[(t,)](
            x, q, scale, x.stride(0), q.stride(0),
            K=k, BLOCK_K=block, MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX,
            OUT_F32=out_f32, num_warps=warps,
        )  # fmt: skip
    return q, scale
