"""Building a ModelWorker in named steps: its KV over the pages it can address, its runner (CUDA
graphs captured, every kernel warmed up), the worker itself, then its latency profile."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvpool import HostCopy, KVLayout, PagedKV, PagePool, ShardedKV, WeightBuffer
from prism_server.engine.model_runner import DeviceResources, ModelRunner, TensorParallelRunner
from prism_server.engine.model_worker import ModelWorker
from prism_server.engine.profiler import profile_steps
from scheduler.batch_scheduler import SchedulerConfig

log = logging.getLogger(__name__)


def assemble_worker(
    name: str,
    model: torch.nn.Module,
    tokenizer,
    pool: PagePool,
    sched: SchedulerConfig,
    kv_dtype: torch.dtype,
    max_cached_pages: int = 1,
    weights: WeightBuffer | None = None,
    host: HostCopy | None = None,
    pinned: bool = False,
    keep_alive_s: float | None = None,
    resources: DeviceResources | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    profile_budget_s: float = 0.0,
    shard_pools: Sequence[PagePool] = (),
    shard_devices: Sequence[str] = (),
) -> ModelWorker:
    """The worker of `model` in `pool`: its KV, its runner (graphs captured, kernels warmed up),
    then its latency profile.

    weights / host: the model's parameters live in `weights` (mapped now) and `host` holds their
    copy; without them the model cannot be evicted (tests, benchmarks). resources: what the
    device's models share (FlashInfer workspace, CUDA-graph pool). ttft/tpot_slo_s: its SLOs
    (None: SLO_SCALE x the latency model's standalone estimate of each request).
    profile_budget_s: how long the latency profile may take now (0: learn online only).
    shard_pools: a model split over several devices (model a TensorParallel, pool its first
    shard's device's, weights and host a ShardedWeights and a ShardedHostCopy): the other shards'
    pools, in order, and shard_devices their devices' names. Its KV is a ShardedKV, its steps
    eager."""
    device = pool.backend.device
    kv = make_kv(model, name, pool, sched, kv_dtype, max_cached_pages, weights, shard_pools)
    allocated = _allocated(device)
    runner = make_runner(model, kv, device, resources, sharded=bool(shard_pools))
    worker = ModelWorker(
        name,
        kv,
        runner,
        tokenizer,
        sched,
        device,
        weights=weights,
        host=host,
        pinned=pinned,
        keep_alive_s=keep_alive_s,
        resources=resources,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        overhead_bytes=_allocated(device) - allocated,
        shard_devices=shard_devices,
    )
    profile(worker, profile_budget_s)
    return worker


def make_kv(
    model: torch.nn.Module,
    name: str,
    pool: PagePool,
    sched: SchedulerConfig,
    kv_dtype: torch.dtype,
    max_cached_pages: int,
    weights: WeightBuffer | None,
    shard_pools: Sequence[PagePool] = (),
) -> PagedKV | ShardedKV:
    """The model's KV over the pages it can address: the whole pool but its own weights (+ the
    null page); a ShardedKV over every shard's pool for a split model."""
    cfg = model.config
    layout = KVLayout(
        cfg.num_layers,
        sched.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_dtype,
        pool.page_bytes,
        pool.backend.granularity,
    )
    if shard_pools:
        pools = [pool, *shard_pools]
        owns = [w.num_pages for w in weights.parts] if weights is not None else [0] * len(pools)
        room = min(p.capacity + 1 - o for p, o in zip(pools, owns))
        return ShardedKV(pools, name, layout, room, max_cached_pages, sched.enable_prefix_caching)
    own = weights.num_pages if weights is not None else 0
    return PagedKV(
        pool,
        name,
        layout,
        pool.capacity + 1 - own,
        max_cached_pages,
        prefix_caching=sched.enable_prefix_caching,
    )


def make_runner(
    model: torch.nn.Module,
    kv: PagedKV | ShardedKV,
    device: torch.device,
    resources: DeviceResources | None,
    sharded: bool = False,
) -> ModelRunner:
    """The model's runner: its CUDA graphs captured (ModelRunner's construction does) and, on a
    GPU, every kernel compiled before the first request."""
    if sharded:
        runner = TensorParallelRunner(model, kv)
    else:
        runner = ModelRunner(model, kv.cache, device, resources=resources)
    if device.type == "cuda":
        runner.warm_up()
    return runner


def profile(worker: ModelWorker, budget_s: float) -> None:
    """Fit the worker's latency model to synthetic steps run for up to budget_s seconds (0: none;
    it then learns from served steps only). What the profile mapped goes back to the pool."""
    if budget_s <= 0:
        return
    t = time.perf_counter()
    worker.latency.fit_profile(profile_steps(worker.runner, worker.scheduler, budget_s))
    a = worker.kv.allocator
    a.reclaim_pages(a.num_cached_pages)
    log.info(
        "profiled %s in %.2f s: %d shapes",
        worker.name,
        time.perf_counter() - t,
        len(worker.latency.profile),
    )


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
