"""What memory a device gives the page pool: the backend that provides it, and the default budget
(free memory minus the configured models' weights and a reserve)."""

from __future__ import annotations

import torch

from kvpool import CpuBackend, CudaBackend, MemoryBackend, TensorBackend
from models.embedded import resolve_source
from models.layers.causal_lm import weight_bytes as model_weight_bytes
from models.loader import ModelSource, read_config
from models.registry import get_model_class
from prism_server import envs
from prism_server.config import ModelSpec

_CPU_DEFAULT_BUDGET = 2 << 30
# GPU memory kept out of the default KV budget beyond the configured models' weights: activations,
# FlashInfer workspaces, CUDA graph pools, cuBLAS workspaces, the allocator's slack.
_GPU_RESERVE_FRACTION = 0.08
_GPU_MIN_RESERVE = 4 << 30


def make_backend(device: torch.device, kind: str = "vmm") -> MemoryBackend:
    if kind == "tensor":
        return TensorBackend(device)
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        return CudaBackend(device)
    raise NotImplementedError(f"no page-pool backend for device {device}")


def weight_bytes(spec: ModelSpec, device: torch.device) -> int:
    """Parameter bytes of `spec` at its serving dtype, counted on a meta-device build of its
    config (nothing is allocated or read beyond config.json; a GGUF file is converted, as its
    load would do next anyway)."""
    cfg = read_config(ModelSource.parse(resolve_source(spec.source)), envs.gguf_cache_dir())
    with torch.device("meta"):
        model = get_model_class(cfg.hf_architecture)(cfg).to(spec.torch_dtype(device))
    return model_weight_bytes(model)


def default_kv_budget(device: torch.device, specs: tuple[ModelSpec, ...] = ()) -> int:
    """The page pool's budget when neither EngineConfig.kv_budget_bytes nor PRISM_KV_BUDGET_BYTES
    sets one. CPU: 2 GiB. CUDA: the device's free memory when the engine starts, minus the weights
    of the models the config names (they load after the pool is made), minus a reserve of
    max(4 GiB, 8% of the device) for activations, workspaces and graphs. Models loaded later must
    fit in that reserve, or set the budget explicitly."""
    if device.type != "cuda":
        return _CPU_DEFAULT_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(_GPU_MIN_RESERVE, int(total * _GPU_RESERVE_FRACTION))
    weights = 0
    for s in specs:
        try:
            weights += weight_bytes(s, device)
        except Exception:  # a model that cannot even be sized fails (and is reported) at load
            continue
    budget = free - weights - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for KV: {free / 2**30:.1f} GiB free, weights "
            f"{weights / 2**30:.1f} GiB, reserve {reserve / 2**30:.1f} GiB; set kv_budget_bytes"
        )
    return budget


def kv_budget(config, device: torch.device) -> int:
    """The budget an engine config gives its device's pool."""
    return (
        config.kv_budget_bytes or envs.kv_budget_bytes() or default_kv_budget(device, config.models)
    )
