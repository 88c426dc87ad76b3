"""Triton kernels for the small elementwise ops of a small decode step, in place of FlashInfer's:
the residual add + RMSNorm, and SiLU(gate) * up. At batch 1 each is a few microseconds of
latency between two GEMMs; these can also

- start while the GEMM before them finishes (`pdl`: a programmatic dependent launch, Hopper):
  what the GEMM does not write (the norm's weight, the residual stream) is read first, then the
  kernel waits for the GEMM (`gdc_wait`) before reading its output;
- ask the L2 for the next GEMM's weights as their programs start (`prefetch`: two byte ranges,
  as models.layers.l2_prefetch plans them; programs beyond the op's own ride along to spread
  the asks over the GPU).

Numerics as FlashInfer's kernels: the add and the sum of squares in fp32, the normalized row
scaled by the weight in fp32, then one cast; SiLU as x / (1 + exp(-x)) in fp32. Both run under
Triton's interpreter too (the CPU tests), without `pdl` and `prefetch`.
"""

from __future__ import annotations

import functools

import torch

from models.attention.triton_ops import (  # noqa: F401 (ask_l2: the kernels')
    PF_CHUNK,
    _pow2,
    ask_l2,
    ask_programs,
    bulk_prefetch_runs_on,
    interpreting,
    prefetch_mode,
    triton_runs_on,
)
from models.layers.triton_gemv import GemvConfig, gemv, gemv_reference
from models.layers.triton_small_gemm import MAX_ROWS as SMALL_MAX_ROWS
from models.layers.triton_small_gemm import (
    Normed,
    SmallGemmConfig,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from models.layers.triton_small_gemm import fits as small_gemm_fits


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows", "pa0", "pn0", "pa1", "pn1"])
    def add_rmsnorm_kernel(
        x_ptr, r_ptr, w_ptr, sx, sr, rows, eps, pa0, pn0, pa1, pn1,
        D: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr, PF_BLOCK: tl.constexpr, PF_CHUNK: tl.constexpr,
    ):  # fmt: skip
        # program i < rows: residual[i] += x[i]; x[i] = rmsnorm(residual[i]) * w, in place
        pid = tl.program_id(0)
        if PREFETCH:
            nprog = tl.num_programs(0)
            ask_l2(pid, nprog, pa0, pn0, pa1, pn1, PF_CHUNK, x_ptr, PF_BLOCK, False, PREFETCH == 2)
        if pid < rows:
            d = tl.arange(0, BLOCK_D)
            m = d < D
            w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + pid * sr + d, mask=m, other=0.0).to(tl.float32)
            if PDL:  # x is the output of the GEMM this kernel may start beside
                tl.extra.cuda.gdc_wait()
            x = tl.load(x_ptr + pid * sx + d, mask=m, other=0.0).to(tl.float32)
            s = x + r
            tl.store(r_ptr + pid * sr + d, s.to(r_ptr.dtype.element_ty), mask=m)
            inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) / D + eps)
            tl.store(x_ptr + pid * sx + d, (s * inv * w).to(x_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["work", "pa0", "pn0", "pa1", "pn1"])
    def silu_mul_kernel(
        gu_ptr, o_ptr, sg, so, work, pa0, pn0, pa1, pn1,
        D: tl.constexpr, BLOCK: tl.constexpr, NBLK: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr, PF_BLOCK: tl.constexpr, PF_CHUNK: tl.constexpr,
    ):  # fmt: skip
        # program i < work: columns (i % NBLK) * BLOCK .. of row i // NBLK of silu(gate) * up
        pid = tl.program_id(0)
        if PREFETCH:
            nprog = tl.num_programs(0)
            ask_l2(pid, nprog, pa0, pn0, pa1, pn1, PF_CHUNK, o_ptr, PF_BLOCK, False, PREFETCH == 2)
        if pid < work:
            row = pid // NBLK
            j = (pid % NBLK) * BLOCK + tl.arange(0, BLOCK)
            m = j < D
            if PDL:  # gate_up is the output of the GEMM this kernel may start beside
                tl.extra.cuda.gdc_wait()
            g = tl.load(gu_ptr + row * sg + j, mask=m, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + row * sg + D + j, mask=m, other=0.0).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * u
            tl.store(o_ptr + row * so + j, y.to(o_ptr.dtype.element_ty), mask=m)

    return add_rmsnorm_kernel, silu_mul_kernel


Pair = tuple[tuple[int, int], tuple[int, int]]  # two (address, bytes) ranges


def _grid(work: int, prefetch: Pair | None) -> tuple[int, int, int, int, int]:
    """Programs for `work` programs of the op and the asks of `prefetch` (riders beyond the
    op's own, so that no program asks for more than ASKS_PER_PROGRAM chunks: ask_programs),
    and the ranges as kernel arguments."""
    ranges = prefetch or ((0, 0), (0, 0))
    (a0, n0), (a1, n1) = ranges
    return max(work, ask_programs(ranges)), a0, n0, a1, n1


def _options(warps: int, pdl: bool, prefetch: Pair | None, keep: bool) -> dict:
    mode = prefetch_mode(prefetch is not None, keep)
    opts = dict(PDL=pdl, PREFETCH=mode, PF_BLOCK=32 * warps, PF_CHUNK=PF_CHUNK)
    return {**opts, "num_warps": warps, **({"launch_pdl": True} if pdl else {})}


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    prefetch: Pair | None = None,
    pdl: bool = False,
    keep: bool = False,
) -> None:
    """residual += x, then x = rmsnorm(residual) * weight, both in place (FlashInfer's
    fused_add_rmsnorm); x, residual: [T, D], last dim contiguous. keep: the bytes asked of the
    L2 (`prefetch`) are the last it evicts."""
    rows, dim = x.shape
    assert x.stride(1) == residual.stride(1) == 1 and weight.is_contiguous()
    warps = 8 if dim > 4096 else 4
    n, a0, n0, a1, n1 = _grid(rows, prefetch)
    _build(interpreting())[0][(n,)](
        x, residual, weight, x.stride(0), residual.stride(0), rows, eps, a0, n0, a1, n1,
        D=dim, BLOCK_D=_pow2(dim), **_options(warps, pdl, prefetch, keep),
    )  # fmt: skip


SILU_BLOCK = 1024  # columns a program of silu_mul


def silu_mul(
    gate_up: torch.Tensor, prefetch: Pair | None = None, pdl: bool = False, keep: bool = False
):
    """gate_up: [T, 2 * D] (gate, then up; last dim contiguous) -> silu(gate) * up, [T, D]
    (FlashInfer's silu_and_mul); keep as add_rmsnorm's."""
    rows, two_d = gate_up.shape
    dim = two_d // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(rows, dim, dtype=gate_up.dtype, device=gate_up.device)
    nblk = -(-dim // SILU_BLOCK)
    n, a0, n0, a1, n1 = _grid(rows * nblk, prefetch)
    _build(interpreting())[1][(n,)](
        gate_up, out, gate_up.stride(0), out.stride(0), rows * nblk, a0, n0, a1, n1,
        D=dim, BLOCK=SILU_BLOCK, NBLK=nblk, **_options(4, pdl, prefetch, keep),
    )  # fmt: skip
    return out


class StepOps:
    """A small decode step's norms and activation through these kernels (ForwardContext's
    step_ops: decode graphs of few sequences), and with `gemv` (a tiling), a one-row step's
    layers as chains of GEMVs that carry them (models.layers.triton_gemv). pdl: each a
    programmatic dependent launch; prefetch: whether the kernels can ask the L2 for bytes
    (Hopper); keep: what they ask for is the last the L2 evicts; norms: the norms and
    activation of the steps the GEMVs do not take through these kernels (else FlashInfer's);
    glu: the SiLU * up made by the gate_up GEMV from its outputs, the down GEMV then a plain one
    (else the down GEMV computes it from gate_up's outputs; a tiling of one row a program
    cannot pair a gate row with its up row and keeps that); small: the projections of steps of
    a few rows (at most 16) as Triton's small GEMMs under this tiling
    (models.layers.triton_small_gemm), not cuBLAS's."""

    def __init__(
        self,
        pdl: bool = False,
        prefetch: bool = False,
        keep: bool = False,
        norms: bool = True,
        gemv: GemvConfig | None = None,
        glu: bool = False,
        small: SmallGemmConfig | None = None,
    ):
        self.pdl, self.takes_prefetch, self.keep = pdl, prefetch, keep
        self.norms, self.gemv_config = norms, gemv
        self.glu = glu and gemv is not None and gemv.block_n >= 2
        self.small_config = small

    def fits_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, unit_offset: bool) -> bool:
        """Whether add_rmsnorm computes this norm (Llama's, rows contiguous, a GPU's dtype)."""
        return (
            self.norms
            and not unit_offset
            and x.dim() == 2
            and x.stride(1) == residual.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16)
        )

    def fits_silu_mul(self, gate_up: torch.Tensor, act: str) -> bool:
        return self.norms and act == "silu" and gate_up.dtype != torch.float32

    def takes_layer(self, layer: torch.nn.Module, x: torch.Tensor, whole: bool) -> bool:
        """Whether a decoder layer's step runs as a chain of kernels that carry its norms,
        activation and residual adds: GEMVs for one row (`gemv`, DecoderLayer.gemv_layer),
        small GEMMs for at most MAX_ROWS (`small`, DecoderLayer.small_layer; one row too where
        the GEMVs are off). The rows contiguous, of a GPU's dtype, a whole model (whole: no
        shards' sums between the projections), SiLU, and the projections' weights row-major,
        of x's dtype."""
        few = 1 <= x.shape[0] <= SMALL_MAX_ROWS and self.small_config is not None
        if not (
            (self.gemv_takes(x) or few)
            and whole
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16)
            and layer.mlp.act == "silu"
        ):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return all(p.weight.is_contiguous() and p.weight.dtype == x.dtype for p in projections)

    def gemv_takes(self, x: torch.Tensor) -> bool:
        """Whether a fused layer of x's rows runs as GEMVs (else as small GEMMs)."""
        return x.shape[0] == 1 and self.gemv_config is not None

    def project(self, linear: torch.nn.Linear, x: torch.Tensor | Normed, **ops):
        """A fused layer's projection with the ops beside it: a GEMV for one row where the
        GEMVs are on (triton_gemv.gemv's ops), else a small GEMM (triton_small_gemm's)."""
        if isinstance(x, torch.Tensor) and self.gemv_takes(x):
            return gemv(linear, x, config=self.gemv_config, pdl=self.pdl, **ops)
        return small_gemm(linear, x, self.small_config, **ops)

    def prenorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Normed:
        """The first layer's norm input for its small GEMMs (triton_small_gemm.prenorm)."""
        return prenorm(x, weight, eps)

    def linear(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """linear(x): a small GEMM where one takes it (`small`: at most 16 rows, a row-major
        weight of x's dtype), else the module itself."""
        if self.small_config is not None and small_gemm_fits(linear, x):
            return small_gemm(linear, x, self.small_config)
        return linear(x)

    def add_rmsnorm(self, x, residual, weight, eps, prefetch: Pair | None = None):
        add_rmsnorm(x, residual, weight, eps, prefetch, self.pdl, self.keep)
        return x, residual

    def silu_mul(self, gate_up, prefetch: Pair | None = None):
        return silu_mul(gate_up, prefetch, self.pdl, self.keep)


STEP_OPS_MAX_BATCH = 16  # decode graphs of at most this many sequences take them


def load_step_ops(
    device: torch.device,
    pdl: bool = False,
    prefetch: bool = False,
    keep: bool = False,
    norms: bool = True,
    gemv: GemvConfig | None = None,
    glu: bool = False,
    small: SmallGemmConfig | None = None,
) -> tuple[StepOps | None, str | None]:
    """The step kernels for `device`, built and checked there against the torch reference (the
    norms' kernels with `norms`, with PDL and an L2 prefetch when asked and on Hopper; the
    GEMVs' three kinds with `gemv`; the small GEMM with `small`), or None and why not."""
    if not triton_runs_on(device):
        return None, "Triton does not run here"
    hopper = bulk_prefetch_runs_on(device)
    ops = StepOps(pdl and hopper, prefetch and hopper, keep, norms, gemv, glu, small)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        g = torch.Generator(device=device).manual_seed(0)
        checks = _norm_checks(ops, g, device, dtype) if norms else []
        if gemv is not None:
            checks += _gemv_checks(ops, g, device, dtype)
        if small is not None:
            checks += _small_gemm_checks(ops, g, device, dtype)
        for name, out, ref in checks:
            if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"{name} differs from the reference")
    except Exception as e:  # noqa: BLE001 (kernels that do not build or run here: go without)
        return None, f"its kernels failed ({type(e).__name__}: {str(e)[:200]})"
    return ops, None


def check_width(device: torch.device) -> int:
    """The columns of the load-time checks: a model's width on a GPU (4096); 512 under Triton's
    interpreter, where the checks only show that the kernels build and run (a model's width
    took half a minute there)."""
    return 4096 if device.type == "cuda" else 512


def _norm_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype: torch.dtype):
    """(name, the kernel's result, the reference's) for add + RMSNorm and SiLU * up, two rows of
    `check_width` columns, with an L2 prefetch riding along where the kernels ask."""
    k = check_width(device)
    x, r = (torch.randn(2, k, generator=g, device=device).to(dtype) for _ in range(2))
    w = torch.randn(k, generator=g, device=device).to(dtype)
    pair = ((w.data_ptr(), k), (0, 0)) if ops.takes_prefetch else None
    s = x.float() + r.float()
    want = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(dtype)
    got, _ = ops.add_rmsnorm(x.clone(), r.clone(), w, 1e-5, pair)
    gu = torch.randn(2, 2 * k, generator=g, device=device).to(dtype)
    act = torch.nn.functional.silu(gu[:, :k].float()) * gu[:, k:].float()
    return [("add_rmsnorm", got, want), ("silu_mul", ops.silu_mul(gu, pair), act)]


def _check_linear(k: int, rows: int, g, device, dtype, bias: bool = False) -> torch.nn.Linear:
    """A linear of k inputs and `rows` outputs for the load-time checks, its outputs of unit
    scale (a bias of torch's initialization)."""
    lin = torch.nn.Linear(k, rows, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows, k, generator=g, device=device) * k**-0.5)
    return lin


def _gemv_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype: torch.dtype):
    """(name, the GEMV's result through ops.project, the reference's) for a norm's, an
    activation's and a residual add's GEMV of `check_width` columns."""
    k = check_width(device)
    lin, sq = (_check_linear(k, rows, g, device, dtype) for rows in (256, k))
    x, h, r = (torch.randn(1, k, generator=g, device=device).to(dtype) for _ in range(3))
    nw = torch.randn(k, generator=g, device=device).to(dtype)
    gu = torch.randn(1, 2 * k, generator=g, device=device).to(dtype)
    norm = (nw, 1e-5)
    checks = [
        ("GEMV after a norm", ops.project(lin, x, norm=norm, h=h),
         gemv_reference(lin, x, norm=norm, h=h)),
        ("GEMV after SiLU * up", ops.project(lin, gu, silu=True),
         gemv_reference(lin, gu, silu=True)),
        ("GEMV into the residual", ops.project(sq, x, into=r.clone(), h=h),
         gemv_reference(sq, x, into=r.clone(), h=h)),
    ]  # fmt: skip
    if ops.glu:
        got = ops.project(lin, x, norm=norm, glu=True)
        checks.append(("GEMV making SiLU * up", got, gemv_reference(lin, x, norm=norm, glu=True)))
    return checks


def _small_gemm_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype):
    """(name, the small GEMM's result, the reference's) for 5 and 16 rows of `check_width`
    columns: a plain one with a bias (ops.linear), and a small layer's three kinds (after a
    norm, into the residual handing the next norm its input, making SiLU * up)."""
    k = check_width(device)
    lin, sq = (_check_linear(k, rows, g, device, dtype) for rows in (320, k))
    biased = _check_linear(k, 320, g, device, dtype, bias=True)
    norm = (torch.randn(k, generator=g, device=device).to(dtype), 1e-5)
    checks = []
    for m in (5, 16):
        x, r = (torch.randn(m, k, generator=g, device=device).to(dtype) for _ in range(2))
        c, normed = ops.small_config, prenorm(x, *norm)
        stream, nxt = small_gemm_reference(sq, x, into=r.clone(), norm=norm)
        got = small_gemm(sq, x, c, into=(into := r.clone()), norm=norm)
        checks += [
            (f"small GEMM of {m} rows", ops.linear(biased, x), biased(x)),
            (f"small GEMM of {m} rows after a norm", small_gemm(lin, normed, c),
             small_gemm_reference(lin, x, pre=norm)),
            (f"small GEMM of {m} rows into the residual", into, stream),
            (f"the next norm's rows out of {m} rows' residual add", got.rows, nxt),
            (f"small GEMM of {m} rows making SiLU * up", small_gemm(lin, normed, c, glu=True),
             small_gemm_reference(lin, x, pre=norm, glu=True)),
        ]  # fmt: skip
    return checks
