"""Every environment knob of Prism, typed, in one place (all prefixed PRISM_). Read here, when an
engine is built, and passed down as values: nothing below prism_server reads the environment."""

from __future__ import annotations

import os
import re
from pathlib import Path


def _int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(float(v))
    except ValueError:
        raise ValueError(f"{name} must be a number, got {v!r}") from None


def _flag(name: str, default: bool) -> bool:
    """A yes/no knob: 0, false or no is off, any other value on; unset or empty: default."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v not in ("0", "false", "no")


def cache_dir() -> Path:
    """Where converted model files are cached (PRISM_CACHE_DIR, default ~/.cache/prism)."""
    return Path(os.environ.get("PRISM_CACHE_DIR") or Path.home() / ".cache" / "prism")


def gguf_cache_dir() -> Path:
    """Where GGUF files are converted to HF-style directories (under cache_dir())."""
    return cache_dir() / "gguf"


def kv_budget_bytes() -> int | None:
    """KV room per device beside every configured model's weights, in bytes
    (PRISM_KV_BUDGET_BYTES, as EngineConfig.kv_budget_bytes); unset = the per-device default."""
    return _int("PRISM_KV_BUDGET_BYTES", None)


def cpu_threads() -> int | None:
    """torch intra-op threads on CPU (PRISM_CPU_THREADS); unset = torch's default."""
    return _int("PRISM_CPU_THREADS", None)


def fused_kernels() -> bool:
    """Use FlashInfer's fused norm/activation kernels on CUDA (PRISM_FUSED_KERNELS, default 1)."""
    return _flag("PRISM_FUSED_KERNELS", True)


def decode_tensor_cores() -> bool:
    """Decode attention through FlashInfer's tensor-core kernel (PRISM_DECODE_TENSOR_CORES,
    default 1; 0: its CUDA-core decode kernel)."""
    return _flag("PRISM_DECODE_TENSOR_CORES", True)


def prefill_backend() -> str:
    """FlashInfer's prefill backend for steps of at least prefill_backend_min_tokens query
    tokens (PRISM_PREFILL_BACKEND: auto, the default: fa3 where it runs; fa3; fa2)."""
    return os.environ.get("PRISM_PREFILL_BACKEND") or "auto"


def prefill_backend_min_tokens() -> int:
    """Steps of fewer query tokens prefill through fa2 whatever PRISM_PREFILL_BACKEND says
    (PRISM_PREFILL_BACKEND_MIN_TOKENS, default 1024)."""
    n = _int("PRISM_PREFILL_BACKEND_MIN_TOKENS", 1024)
    if n is None or n < 0:
        raise ValueError(f"PRISM_PREFILL_BACKEND_MIN_TOKENS must be >= 0, got {n}")
    return n


def decode_split_pages() -> int | None:
    """Decode attention's split of each sequence's KV, in pages (PRISM_DECODE_SPLIT_PAGES;
    unset: FlashInfer's planner; 0: no split)."""
    return _int("PRISM_DECODE_SPLIT_PAGES", None)


def decode_backend() -> str:
    """Decode-only steps' attention kernel (PRISM_DECODE_BACKEND: triton, Prism's own, the
    default; flashinfer, FlashInfer's decode wrapper; xqa, TensorRT-LLM's decode kernel as
    FlashInfer ships it)."""
    return os.environ.get("PRISM_DECODE_BACKEND") or "triton"


def decode_backend_max_batch() -> int | None:
    """PRISM_DECODE_BACKEND runs decode steps of at most this many sequences, FlashInfer's
    decode the larger ones (PRISM_DECODE_BACKEND_MAX_BATCH, default 16)."""
    return _int("PRISM_DECODE_BACKEND_MAX_BATCH", 16)


def triton_decode() -> tuple[int, int, int, bool, bool, int]:
    """The Triton decode kernel's most splits of a sequence's KV, its loop's pipelining depth,
    the programs a launch aims at for each SM (a small batch's sequences are split until there
    are that many), whether a launch of at most one program an SM (batch 1) takes tiles twice
    as wide, whether it is a programmatic dependent launch, starting while the qkv
    projection finishes, and a program's warps (PRISM_TRITON_SPLITS, default 16;
    PRISM_TRITON_STAGES, default 3; PRISM_TRITON_WAVES, default 2; PRISM_TRITON_WIDE_TILE,
    default 1; PRISM_TRITON_PDL, default 0; PRISM_TRITON_WARPS, default 4: 1, 2, 4 or 8)."""
    splits, stages = _int("PRISM_TRITON_SPLITS", 16), _int("PRISM_TRITON_STAGES", 3)
    waves, wide = _int("PRISM_TRITON_WAVES", 2), _flag("PRISM_TRITON_WIDE_TILE", True)
    pdl, warps = _flag("PRISM_TRITON_PDL", False), _int("PRISM_TRITON_WARPS", 4)
    return splits, stages, waves, wide, pdl, warps


def triton_dense(default: tuple[int, int] | None) -> tuple[int, int] | None:
    """The Triton decode kernel's warps and stages in a launch of more programs than SMs
    (batches past one): PRISM_TRITON_DENSE=WARPS:STAGES; unset or 1: `default` (2:2); 0:
    PRISM_TRITON_WARPS and PRISM_TRITON_STAGES, as in every other launch (None)."""
    parts = _tiling("PRISM_TRITON_DENSE", "1", "WARPS:STAGES")
    if parts is None:
        return None
    if not parts:
        return default
    if len(parts) != 2:
        raise ValueError(f"PRISM_TRITON_DENSE must be 0, 1 or WARPS:STAGES, got {parts}")
    return parts[0], parts[1]


def fused_rope_write() -> bool:
    """Decode steps, steps of fresh prompts and the piecewise graphs' segments rotate q and k
    and write K/V in one Triton kernel (PRISM_ROPE_WRITE, default 1; 0: FlashInfer's rope, then
    an indexed store or, for prompts, FlashInfer's append; the segments copy q, k and v too)."""
    return _flag("PRISM_ROPE_WRITE", True)


def l2_prefetch_mib() -> tuple[int, int, int]:
    """Decode graphs ask the L2 for the next GEMMs' weights while HBM idles:
    PRISM_L2_PREFETCH=A[,M[,N]] (or A:M:N), the MiB asked during each attention (its o_proj's
    weights, then the head of the MLP's gate_up), each activation (the head of the down
    projection's) and each layer's input norm (the head of its qkv projection's); unset or 0:
    never."""
    v = (os.environ.get("PRISM_L2_PREFETCH") or "0").replace(":", ",").split(",")
    try:
        mib = [int(x) for x in v]
    except ValueError:
        mib = []
    if not 1 <= len(mib) <= 3:
        raise ValueError(f"PRISM_L2_PREFETCH must be A[,M[,N]] in MiB, got {','.join(v)!r}")
    a, m, n = mib + [0] * (3 - len(mib))
    return a, m, n


def l2_prefetch_inline() -> bool:
    """The attention window's L2 prefetch asked by the Triton decode kernel itself, where it
    runs the step (PRISM_L2_PREFETCH_INLINE, default 0: a kernel on a side stream)."""
    return _flag("PRISM_L2_PREFETCH_INLINE", False)


def l2_prefetch_keep() -> bool:
    """What the L2 prefetches ask for is the last the L2 evicts, an evict_last policy
    (PRISM_L2_PREFETCH_KEEP, default 0: the L2's usual policy)."""
    return _flag("PRISM_L2_PREFETCH_KEEP", False)


def triton_step_ops() -> bool:
    """Decode graphs of at most 16 sequences run the residual add + RMSNorm and SiLU * up
    through Prism's Triton kernels, not FlashInfer's (PRISM_TRITON_STEP_OPS, default 0); with
    PRISM_TRITON_PDL they start while the GEMM before them finishes, and with
    PRISM_L2_PREFETCH_INLINE they ask the L2 for the next weights themselves."""
    return _flag("PRISM_TRITON_STEP_OPS", False)


def triton_gemv() -> tuple[int, ...] | None:
    """One-row decode graphs run each Llama layer as four Triton GEMVs that carry its norms,
    activation and residual adds (models.layers.triton_gemv), not cuBLAS's GEMMs with kernels
    between them: PRISM_TRITON_GEMV=1, or the GEMVs' tiling BN[:BK[:WARPS[:UNROLL]]] (output
    rows a program, columns a loop step, warps, the loop's unrolling); unset: on, under the
    default tiling; 0: off. With PRISM_TRITON_PDL each asks the L2 for its weights before
    waiting for the kernel before it."""
    return _tiling("PRISM_TRITON_GEMV", "1", "BN[:BK[:WARPS[:UNROLL]]]")


def triton_gemv_glu() -> bool:
    """The GEMVs' SiLU * up made by the gate_up GEMV from its outputs, the down GEMV then a
    plain one, not computed by every program of the down GEMV (PRISM_TRITON_GEMV_GLU,
    default 1; 0 off)."""
    return _flag("PRISM_TRITON_GEMV_GLU", True)


# GPUs whose decode took longer with the small GEMMs under the default tiling than with
# cuBLAS's (docs/BENCHMARKS.md: batch 16 on the H200 x1.028; on the H100 x0.959)
SMALL_GEMM_SLOWER_ON = ("H200",)


def triton_small_gemm(device_name: str = "") -> str | None:
    """Decode graphs of 2 to 16 sequences (and of one where the GEMVs are off) run each Llama
    layer as four Triton small GEMMs carrying its norms, activation and residual adds
    (models.layers.triton_small_gemm; other layers their projections), not cuBLAS's:
    PRISM_TRITON_SMALL_GEMM=1, or the tiling BN[:BK[:WARPS[:STAGES]]] (weight rows a program,
    columns a loop step, warps, the loop's pipelining depth), optionally /BN:BK:WARPS:STAGES
    for the projections of 16384 outputs and more (gate_up); 0: off; unset: on, under the
    default tiling, but off on the GPUs of SMALL_GEMM_SLOWER_ON (device_name: the GPU's name).
    Returns the tiling's text ("" for the default: SmallGemmConfig.parse's), or None."""
    slower = any(name in device_name for name in SMALL_GEMM_SLOWER_ON)
    v = _switched("PRISM_TRITON_SMALL_GEMM", "0" if slower else "1")
    form = "BN[:BK[:WARPS[:STAGES]]][/BN:BK:WARPS:STAGES]"
    if v and not re.fullmatch(r"\d+([:,]\d+){0,3}(/\d+([:,]\d+){0,3})?", v):
        raise ValueError(f"PRISM_TRITON_SMALL_GEMM must be 0, 1 or {form}, got {v!r}")
    return v


def _switched(name: str, unset: str) -> str | None:
    """A kernel's knob of 0 (off: None), 1 (on: "") or anything else (its text); `unset` when
    the variable is."""
    v = os.environ.get(name) or unset
    if v in ("0", "false", "no"):
        return None
    return "" if v in ("1", "true", "yes") else v


def _tiling(name: str, unset: str, form: str) -> tuple[int, ...] | None:
    """A kernel's knob of 0 (off: None), 1 (on, its default tiling: ()) or a tiling of up to
    four integers (`form`); `unset` when the variable is."""
    v = _switched(name, unset)
    if not v:
        return None if v is None else ()
    try:
        parts = tuple(int(p) for p in v.replace(",", ":").split(":"))
    except ValueError:
        parts = ()
    if not parts or len(parts) > 4:
        raise ValueError(f"{name} must be 0, 1 or {form}, got {v!r}")
    return parts


def ragged_prefill() -> bool:
    """Steps of fresh prompts attend over their own K/V tensors, not the paged cache
    (PRISM_RAGGED_PREFILL, default 1)."""
    return _flag("PRISM_RAGGED_PREFILL", True)


def piecewise_graphs() -> bool:
    """Capture piecewise CUDA graphs for the steps decode graphs cannot run: prefill chunks,
    mixed batches (PRISM_PIECEWISE_GRAPHS, default 1)."""
    return _flag("PRISM_PIECEWISE_GRAPHS", True)


def piecewise_max_tokens() -> int | None:
    """The largest step replayed through piecewise graphs (PRISM_PIECEWISE_MAX_TOKENS; unset:
    1024). Larger steps run eagerly; each bucket past 512 tokens (one every 256) costs capture
    time and graph memory."""
    n = _int("PRISM_PIECEWISE_MAX_TOKENS", None)
    if n is not None and n < 8:
        raise ValueError(f"PRISM_PIECEWISE_MAX_TOKENS must be at least 8, got {n}")
    return n


def decode_lanes() -> int:
    """Streams per device that models step on at once (PRISM_DECODE_LANES, default 1). With 2,
    each model is given a lane in turn; beside the arbitrator's pick, a model of the other lane
    whose requests are decoding steps too, on its own stream (small models leave most of the
    GPU idle). Each lane has its own FlashInfer workspace and CUDA-graph pool."""
    n = _int("PRISM_DECODE_LANES", 1)
    if n < 1:
        raise ValueError(f"PRISM_DECODE_LANES must be at least 1, got {n}")
    return n


def launch_ahead() -> bool | None:
    """Launch a model's next decode step before its last one's tokens are read
    (PRISM_LAUNCH_AHEAD: 1 or 0; unset: on a GPU only)."""
    v = os.environ.get("PRISM_LAUNCH_AHEAD")
    if v is None or v == "":
        return None
    return v not in ("0", "false", "no")


def step_trace() -> Path | None:
    """Where each device's engine thread writes one JSON line per step it runs (PRISM_STEP_TRACE;
    the device's name is added to the file name): its start and length, the model, its shape,
    the latency model's estimate, and the arbitrator's pick. A diagnostic of scheduling, for a
    run replayed against the simulator; unset = none."""
    v = os.environ.get("PRISM_STEP_TRACE")
    return Path(v) if v else None
