"""What memory a device gives the page pool (weights and KV): the backend that provides it,
the budget (free memory minus a reserve by default), and the pool of that budget."""

from __future__ import annotations

import functools
import os

import torch

from kvpool import (
    CpuBackend,
    CudaBackend,
    HostBudget,
    MemoryBackend,
    PagePool,
    TensorBackend,
    WeightLayout,
)
from models.embedded import resolve_source
from models.layers.causal_lm import weight_bytes as model_weight_bytes
from models.loader import ModelSource, meta_model, read_config
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


@functools.lru_cache(maxsize=64)
def _meta_model(spec: ModelSpec, device: torch.device):
    """A meta-device build of `spec` (no memory); cached: start-up sizes each model for the host
    budget and for the pool budget."""
    cfg = read_config(ModelSource.parse(resolve_source(spec.source)), envs.gguf_cache_dir())
    return meta_model(cfg, spec.torch_dtype(device), spec.quantization)


def weight_bytes(spec: ModelSpec, device: torch.device) -> int:
    """Parameter bytes of `spec` at its serving dtype (FP8 projections and their scales where
    spec.quantization says so), counted on a meta-device build of its
    config (nothing is allocated or read beyond config.json; a GGUF file is converted, as its
    load would do next anyway)."""
    return model_weight_bytes(_meta_model(spec, device))


def weight_pool_bytes(spec: ModelSpec, device: torch.device, page_bytes: int) -> int:
    """Pool bytes `spec`'s weight buffer takes: its packed layout in whole pages."""
    model = _meta_model(spec, device)
    layout = WeightLayout.pack((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters())
    return layout.num_pages(page_bytes) * page_bytes


def default_pool_budget(device: torch.device) -> int:
    """The page pool's budget when the config sets none. CPU: 2 GiB. CUDA: the device's free
    memory when the engine starts minus a reserve of max(4 GiB, 8% of the device) for
    activations, workspaces and graphs."""
    if device.type != "cuda":
        return _CPU_DEFAULT_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(_GPU_MIN_RESERVE, int(total * _GPU_RESERVE_FRACTION))
    budget = free - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the pool: {free / 2**30:.1f} GiB free, reserve "
            f"{reserve / 2**30:.1f} GiB; set pool_budget_bytes"
        )
    return budget


def pool_budget(config, device: torch.device) -> int:
    """The budget an engine config gives its device's pool (weights and KV). With a KV budget:
    it beside every model's weights, as any device may hold any model; over several GPUs, at
    most what the GPU has free."""
    if config.pool_budget_bytes:
        return config.pool_budget_bytes
    kv = config.kv_budget_bytes
    if not kv:
        return default_pool_budget(device)
    weights = 0
    for s in config.models:
        try:
            weights += weight_pool_bytes(s, device, config.page_bytes)
        except Exception:  # a model that cannot even be sized fails (and is reported) at load
            continue
    if config.devices > 1 and device.type == "cuda":
        return min(kv + weights, default_pool_budget(device))
    return kv + weights


def device_pool(config, device: torch.device) -> PagePool:
    """The page pool of one device, of pool_budget's size. On a GPU it creates every handle
    now (creating is the slow driver call) and keeps them; on the host it creates them on
    demand."""
    budget = pool_budget(config, device)
    precreate = budget // config.page_bytes if device.type == "cuda" else 0
    backend = make_backend(device, config.memory_backend)
    return PagePool(backend, config.page_bytes, budget, precreate)


def host_budget(config) -> int:
    if config.host_budget_bytes:
        return config.host_budget_bytes
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_host_budget(config, device: torch.device) -> HostBudget:
    """Every model keeps a host copy of its weights: refuse, listing models and sizes, a config
    whose copies do not fit the host budget; -> the budget with those copies taken (adapters
    take theirs as they load)."""
    sizes = {}
    for s in config.models:
        try:
            sizes[s.name] = weight_bytes(s, device)
        except Exception:  # it fails (and is reported) at load
            continue
    budget = host_budget(config)
    if sum(sizes.values()) > budget:
        listing = ", ".join(f"{n} {b / 2**30:.2f} GiB" for n, b in sizes.items())
        raise ValueError(
            f"the host copies of the models' weights need {sum(sizes.values()) / 2**30:.2f} GiB "
            f"but host_budget_bytes allows {budget / 2**30:.2f} GiB ({listing})"
        )
    return HostBudget(budget, used=sum(sizes.values()))
