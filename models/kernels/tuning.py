"""The kernels' tuned settings as data: one JSON table per GPU model (configs/).

configs/default.json holds every setting; configs/<GPU>.json (the name torch.cuda.
get_device_name() gives, each run of characters other than letters and digits made `_`) only
those where that GPU differs. CPUs and unknown GPUs take default.json. A lab override
(PRISM_KERNEL_CONFIG, read by prism_server.envs) goes on top. Each entry is
{"value": ..., "run": "the docs/BENCHMARKS.md entry that chose it"} ("run" optional in an
override). An unknown key or a bad value is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from models.kernels.triton_gemv import GemvConfig
from models.kernels.triton_ops import DENSE_LAUNCH, SPLITS_LIMIT
from models.kernels.triton_small_gemm import SmallGemmConfig

CONFIGS = Path(__file__).parent / "configs"
PREFILL_BACKENDS = ("fa2", "fa3", "auto")
WARPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels a device runs, and their tunings; the defaults are configs/default.json's.

    - prefill_backend: FlashInfer's prefill for steps of at least prefill_backend_min_tokens
      query tokens ("auto": fa3 where it runs, else fa2); fa2 for the smaller ones.
    - decode_backend_max_batch: decode steps (and graphs) of at most this many sequences run
      Prism's Triton decode kernel (where it runs), larger ones FlashInfer's decode wrapper
      (0: FlashInfer's for every batch).
    - triton_max_splits, triton_stages, triton_waves, triton_warps: the Triton decode kernel's
      most programs a (sequence, KV head), its loop's pipelining depth, the programs a launch
      aims at for each SM, a program's warps; triton_dense: (warps, stages) of its launches of
      more programs than SMs (None: triton_warps and triton_stages).
    - gemv: one-row decode graphs run each Llama layer as four Triton GEMVs under this tiling
      (None: small GEMMs, or cuBLAS's).
    - small_gemm: decode graphs of at most 16 sequences run each Llama layer as four Triton
      small GEMMs under this tiling (None: cuBLAS's GEMMs).
    - piecewise_max_tokens: the largest step replayed through piecewise graphs (each bucket past
      512 tokens, one every 256, costs capture time and graph memory).
    - fp8_scaled_mm_min_rows: an FP8 model's projections (models.layers.fp8_linear) run
      torch._scaled_mm, the activations quantized per token, for steps of at least this many
      rows on a GPU that runs it (compute capability 8.9 or more; bf16); smaller steps, and
      every step elsewhere, the dequantized weight (None: always). Decode graphs whose layers
      run the GEMVs or small GEMMs above read the FP8 weights there instead, whatever this
      says.
    - fp8_swap_max_rows: an FP8 model's steps of at most this many rows that run
      torch._scaled_mm run it with its operands swapped (models.layers.fp8_linear; 0: none).
    - fp8_small_gemm: an FP8 model's decode graphs of 2 to 16 sequences run the small GEMMs
      above too (False: its projections' own path, torch._scaled_mm). One-row graphs run the
      GEMVs either way."""

    prefill_backend: str = "auto"
    prefill_backend_min_tokens: int = 1024
    decode_backend_max_batch: int = 16
    triton_max_splits: int = 16
    triton_stages: int = 3
    triton_waves: int = 2
    triton_warps: int = 4
    triton_dense: tuple[int, int] | None = DENSE_LAUNCH
    gemv: GemvConfig | None = GemvConfig()
    small_gemm: SmallGemmConfig | None = SmallGemmConfig()
    piecewise_max_tokens: int = 1024
    fp8_scaled_mm_min_rows: int | None = 1
    fp8_swap_max_rows: int = 0
    fp8_small_gemm: bool = False

    def __post_init__(self):
        def refuse(key: str, want: str):
            raise ValueError(f"{key}: {getattr(self, key)!r}, want {want}")

        if self.prefill_backend not in PREFILL_BACKENDS:
            refuse("prefill_backend", " or ".join(PREFILL_BACKENDS))
        for key, least in (
            ("prefill_backend_min_tokens", 0),
            ("decode_backend_max_batch", 0),
            ("triton_stages", 1),
            ("triton_waves", 1),
            ("piecewise_max_tokens", 8),
            ("fp8_swap_max_rows", 0),
        ):
            v = getattr(self, key)
            if not _is_int(v) or v < least:
                refuse(key, f"an integer >= {least}")
        if not _is_int(self.triton_max_splits) or not 1 <= self.triton_max_splits <= SPLITS_LIMIT:
            refuse("triton_max_splits", f"an integer from 1 to {SPLITS_LIMIT}")
        rows = self.fp8_scaled_mm_min_rows
        if rows is not None and (not _is_int(rows) or rows < 1):
            refuse("fp8_scaled_mm_min_rows", "an integer >= 1 or null")
        if not isinstance(self.fp8_small_gemm, bool):
            refuse("fp8_small_gemm", "true or false")
        if self.triton_warps not in WARPS:
            refuse("triton_warps", "1, 2, 4 or 8")
        dense = self.triton_dense
        if dense is not None and not (
            isinstance(dense, tuple)
            and len(dense) == 2
            and dense[0] in WARPS
            and _is_int(dense[1])
            and dense[1] >= 1
        ):
            refuse("triton_dense", "[warps (1, 2, 4 or 8), stages (>= 1)] or null")
        if self.gemv is not None and not isinstance(self.gemv, GemvConfig):
            refuse("gemv", "a GemvConfig or None")
        if self.small_gemm is not None and not isinstance(self.small_gemm, SmallGemmConfig):
            refuse("small_gemm", "a SmallGemmConfig or None")

    def prefill_backend_for(self, tokens: int) -> str:
        """The prefill backend of a step of `tokens` query tokens."""
        return self.prefill_backend if tokens >= self.prefill_backend_min_tokens else "fa2"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _from_json(key: str, value):
    """A setting's JSON value as KernelConfig holds it."""
    if value is None:
        return None
    if key == "triton_dense":
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise ValueError(f"{key}: {value!r}, want [warps, stages] or null")
        return tuple(value)
    if key == "gemv":
        if not isinstance(value, list) or not 1 <= len(value) <= 5:
            raise ValueError(f"{key}: {value!r}, want [BN, BK, WARPS, UNROLL(, ONE_PASS)] or null")
        if not all(_is_int(v) for v in value):
            raise ValueError(f"{key}: {value!r}, want integers")
        return GemvConfig(*value)
    if key == "small_gemm":
        if not isinstance(value, str):
            raise ValueError(f"{key}: {value!r}, want 'BN:BK:WARPS:STAGES[/BN:BK:WARPS:STAGES]'")
        return SmallGemmConfig.parse(value)
    return value


FIELDS = tuple(f.name for f in dataclasses.fields(KernelConfig))


def read_table(path: Path, need_run: bool = True) -> dict:
    """One table's settings, {key: value as KernelConfig holds it}; refuses an unknown key, an
    entry not of the form {"value": ..., "run": ...}, or a value of the wrong kind."""
    try:
        table = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: want one JSON object of settings")
    out = {}
    for key, entry in table.items():
        if key not in FIELDS:
            raise ValueError(f"{path}: unknown setting {key!r} (settings: {', '.join(FIELDS)})")
        if (
            not isinstance(entry, dict)
            or "value" not in entry
            or set(entry) - {"value", "run"}
            or (need_run and not isinstance(entry.get("run"), str))
        ):
            raise ValueError(f'{path}: {key}: want {{"value": ..., "run": "..."}}, got {entry!r}')
        try:
            out[key] = _from_json(key, entry["value"])
        except (TypeError, ValueError) as e:
            msg = str(e) if str(e).startswith(key) else f"{key}: {e}"
            raise ValueError(f"{path}: {msg}") from None
    return out


def table_name(device_name: str) -> str:
    """The file name of a GPU's table: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name) + ".json"


def load_kernel_config(device_name: str, override: Path | None = None) -> KernelConfig:
    """default.json, then the table of the GPU named device_name where there is one ("" or
    "cpu": none), then the override file. A bad table raises ValueError naming the key."""
    settings = read_table(CONFIGS / "default.json")
    gpu = CONFIGS / table_name(device_name) if device_name else None
    if gpu is not None and gpu.name != "default.json" and gpu.is_file():
        settings.update(read_table(gpu))
    if override is not None:
        settings.update(read_table(override, need_run=False))
    origin = str(override) if override is not None else (gpu.name if gpu else "default.json")
    try:
        return KernelConfig(**settings)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None
