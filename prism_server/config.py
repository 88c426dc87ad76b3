"""Engine configuration: frozen dataclasses layered by scope (engine config holds model specs)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import ConfigDict

from models.quantization import check_quantization
from scheduler.batch_scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its name, where its weights come from, and how it is batched."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # config files: unknown keys are errors

    name: str
    # HF directory, .gguf file, "dummy:<preset>", or an embedded default's name ("" for a LoRA
    # adapter: its weights are its base's)
    source: str = ""
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None  # None = the model's own limit, capped at 8192
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_cached_pages: int = 1  # fully free pages kept mapped for the next burst
    seed: int = 0  # for dummy weights
    ttft_slo_ms: float | None = None  # time-to-first-token target
    tpot_slo_ms: float | None = None  # time-per-output-token target
    pinned: bool = False  # always resident (never evicted)
    keep_alive_s: float | None = None  # evict after this long idle (None: only under pressure)
    max_wait_s: float = 120.0  # a request with no first token by then: 503
    # an evict lets running requests finish for this long, then requeues the rest (0: at once)
    drain_timeout_s: float = 5.0
    max_queued_requests: int = 256  # accepted but not started; beyond it: 503
    # split over this many devices (its device and the next ones): for a model one GPU cannot
    # hold. Such a model is evicted and activated with every shard at once and never moved to
    # other devices; its steps are eager (not captured in graphs), launched ahead as any model's.
    tensor_parallel: int = 1
    # "fp8": the projections' weights in FP8 E4M3 with per-output-channel scales (half of bf16's
    # bytes in the pool, the host copy and each activation); None: the compute dtype's
    quantization: str | None = None
    # a LoRA adapter (PEFT format: adapter_config.json + adapter_model.safetensors) of the
    # configured model `base`: served by its base's steps, its weights its own few pages
    base: str | None = None
    adapter: str | None = None  # the adapter's directory (with base)

    def __post_init__(self):
        if not self.name or self.name.strip() != self.name:
            raise ValueError(f"model name {self.name!r} is not valid")
        if (self.base is None) != (self.adapter is None):
            raise ValueError(
                f"model {self.name}: a LoRA adapter names both base and adapter (its directory)"
            )
        if self.adapter is not None and self.source:
            raise ValueError(
                f"model {self.name}: a LoRA adapter takes no source (its base {self.base!r} "
                "gives the weights)"
            )
        if self.adapter is None and not self.source:
            raise ValueError(f"model {self.name}: source is required")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queued_requests",
            "tensor_parallel",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "keep_alive_s", "max_wait_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be positive")
        if not self.drain_timeout_s >= 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.max_cached_pages < 0:
            raise ValueError("max_cached_pages must be >= 0")
        if self.pinned and self.keep_alive_s is not None:
            raise ValueError(
                f"model {self.name}: a pinned model is never evicted, so keep_alive_s does not "
                "apply; set one or the other"
            )
        check_quantization(self.quantization)
        if self.quantization is not None and self.tensor_parallel > 1:
            raise ValueError(
                f"quantization {self.quantization!r} with tensor_parallel > 1: FP8 weights and "
                "their scales are not split over devices; serve it on one device"
            )

    @property
    def is_adapter(self) -> bool:
        return self.adapter is not None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def scheduler_config(
        self, model_limit: int, reserve_output_tokens: int = 0, prefix_caching: bool = False
    ) -> SchedulerConfig:
        if self.max_model_len is not None and self.max_model_len > model_limit:
            raise ValueError(
                f"model {self.name}: max_model_len {self.max_model_len} is past the "
                f"{model_limit} positions the model has"
            )
        return SchedulerConfig(
            reserve_output_tokens=reserve_output_tokens,
            enable_prefix_caching=prefix_caching,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=min(self.max_model_len or 8192, model_limit),
        )


@dataclass(frozen=True)
class EngineConfig:
    __pydantic_config__ = ConfigDict(extra="forbid")

    models: tuple[ModelSpec, ...] = ()
    device: str = "auto"  # auto = cuda if available, else cpu
    # one physical page (handle) of the pool; 128 MiB: the driver charges per handle (10 GiB grows
    # in 3.1 ms with 128 MiB pages, 5.9 ms with 64 MiB on the H200)
    page_bytes: int = 128 << 20
    # The page pool of each device holds weights and KV. pool_budget_bytes sizes it; or
    # kv_budget_bytes gives the KV room beside the weights of every configured model (all of
    # them resident); neither: a default per device kind (memory_budget.py).
    pool_budget_bytes: int | None = None
    kv_budget_bytes: int | None = None
    # host memory for the models' host copies (the source of truth while offloaded); None = half
    # of the machine's RAM. Checked at start-up.
    host_budget_bytes: int | None = None
    # vmm: pages mapped on demand (the balloon); tensor: one plain allocation per buffer, fully
    # backed (the reference that measures what VMM costs; not for serving many models)
    memory_backend: Literal["vmm", "tensor"] = "vmm"
    # prism (arbitrator, balloon, planner), or a baseline: static (every model resident, fixed
    # equal KV quotas, FCFS), swap (only models with queued work resident, FCFS)
    policy: Literal["prism", "static", "swap"] = "prism"
    # how long each model's latency profile may take at load (0: learn from traffic only;
    # None: 2.5 s on a GPU, 0.25 s on the CPU)
    profile_budget_s: float | None = None
    # admission reserves KV for up to this many output tokens of each request (None: the
    # policy's, 1024 for prism, 0 for the baselines; 0: greedy admission, preempting when the
    # blocks run out)
    reserve_output_tokens: int | None = None
    # devices, each with its own page pool and engine thread: GPUs cuda:0 .. devices-1, or on
    # the CPU, emulated devices (for the multi-device control plane)
    devices: int = 1
    # how often the control loop re-plans residency (prism policy)
    plan_interval_s: float = 0.5
    # full KV blocks are kept by content: a request reuses the longest cached prefix of its
    # prompt; cached blocks no request uses are reclaimed first when memory runs short
    enable_prefix_caching: bool = True
    # every step eager: no CUDA graphs (decode or piecewise) and no decode step launched before
    # the last one's tokens are read (a debugging and measuring switch)
    enforce_eager: bool = False
    # where each device's engine thread writes one JSON line per step it runs (the device's
    # name is added to the file name): its start and length, the model, its shape, the latency
    # model's estimate and the arbitrator's pick; a diagnostic of scheduling, for a run
    # replayed against the simulator. None: no trace
    step_trace: str | None = None
    # torch's intra-op threads on a CPU device (None: torch's default)
    cpu_threads: int | None = None
    # LoRA adapters: the slots of each base model (adapters that can run in one step) and the
    # largest rank accepted
    max_loras: int = 8
    max_lora_rank: int = 64
    # directories searched for an adapter a request names that is not served yet: found as
    # <dir>/<name> (adapter_config.json inside), it is loaded on that first request
    lora_dirs: tuple[str, ...] = ()

    def __post_init__(self):
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique; repeated: {sorted(dup)}")
        if self.page_bytes <= 0:
            raise ValueError("page_bytes must be positive")
        for name in ("pool_budget_bytes", "kv_budget_bytes", "host_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        wide = max(self.models, key=lambda m: m.tensor_parallel, default=None)
        if wide is not None and wide.tensor_parallel > self.devices:
            raise ValueError(
                f"model {wide.name}: tensor_parallel = {wide.tensor_parallel}, but the engine "
                f"has {self.devices} device(s) (set devices)"
            )
        if self.pool_budget_bytes is not None and self.kv_budget_bytes is not None:
            raise ValueError("set pool_budget_bytes or kv_budget_bytes, not both")
        if self.reserve_output_tokens is not None and self.reserve_output_tokens < 0:
            raise ValueError("reserve_output_tokens must be >= 0")
        if self.profile_budget_s is not None and not self.profile_budget_s >= 0:
            raise ValueError("profile_budget_s must be >= 0")
        if self.devices < 1:
            raise ValueError("devices must be at least 1")
        if not 0 < self.plan_interval_s < float("inf"):
            raise ValueError("plan_interval_s must be a positive number of seconds")
        if self.memory_backend not in ("vmm", "tensor"):
            raise ValueError(f"memory_backend must be vmm or tensor, got {self.memory_backend!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be at least 1")
        if self.step_trace is not None and not self.step_trace:
            raise ValueError("step_trace must be a file path")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if any(not d for d in self.lora_dirs):
            raise ValueError("lora_dirs must not hold empty paths")
        by_name = {m.name: m for m in self.models}
        for m in self.models:
            if m.base is None:
                continue
            base = by_name.get(m.base)
            if base is None:
                raise ValueError(
                    f"adapter {m.name}: its base {m.base!r} is not a configured model "
                    f"(configured: {sorted(n for n, s in by_name.items() if not s.is_adapter)})"
                )
            if base.is_adapter:
                raise ValueError(
                    f"adapter {m.name}: its base {m.base!r} is itself an adapter; name the base "
                    "model"
                )
            if base.tensor_parallel > 1:
                raise ValueError(
                    f"adapter {m.name}: its base {m.base!r} is split over devices "
                    "(tensor_parallel > 1), which adapters do not run on"
                )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
