"""Building a model's worker on a device: its weights placed in the device's page pool (read from
its source, or copied in from the host copy of a model moving from another device), a host copy
beside them, and the ModelWorker (runner, graphs, latency profile). `build_worker` runs on the
device's engine thread (the Load and Migrate handlers), between its steps: the runner's graph
warm-ups and the kernels' warm-up use the device's workspaces, which its models' steps use."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpool import HostCopy, ShardedHostCopy, ShardedWeights, WeightBuffer, WeightLayout
from models.embedded import resolve_source
from models.loader import ModelSource, empty_model, load_model, load_shards
from models.tensor_parallel import TensorParallel
from prism_server import envs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.model_worker import ModelWorker
from prism_server.engine.worker_build import assemble_worker
from prism_server.grammar import Grammars
from prism_server.served_model import ServedModel
from scheduler.policy import Policy

if TYPE_CHECKING:
    from kvpool import PagePool
    from prism_server.engine.device_worker import DeviceWorker


@dataclass(frozen=True)
class LoadSettings:
    """What the engine decides for every model it builds (read once, at start-up)."""

    cache_root: Path | str | None  # where GGUF conversions are cached
    reserve_output_tokens: int  # KV reserved per request for its output (the scheduler's)
    enable_prefix_caching: bool
    profile_budget_s: float  # the latency profile at load (a moved model brings its own)
    all_resident: bool  # static: every model pinned, and a load that must evict one fails

    @classmethod
    def of(cls, config: EngineConfig, policy: Policy, device: torch.device) -> LoadSettings:
        """The settings of an engine of `config` under `policy` on `device`."""
        reserve, budget = config.reserve_output_tokens, config.profile_budget_s
        return cls(
            cache_root=envs.gguf_cache_dir(),
            reserve_output_tokens=policy.reserve_output_tokens if reserve is None else reserve,
            enable_prefix_caching=config.enable_prefix_caching,
            profile_budget_s=budget
            if budget is not None
            else 2.5
            if device.type == "cuda"
            else 0.25,
            all_resident=policy.all_resident,
        )


@dataclass(frozen=True)
class Loaded:
    """What the frontend side keeps of a model just built: no engine-thread object."""

    config: Any  # the model's ModelConfig (eos ids, vocabulary)
    tokenizer: Any
    max_model_len: int
    max_kv_tokens: int
    evicted: tuple[str, ...]  # idle models evicted to make room for its weights

    def served(self, spec: ModelSpec, device: str) -> ServedModel:
        """The frontend's view of the model, served on `device`."""
        cfg, tok = self.config, self.tokenizer
        eos = frozenset(cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos |= {tok.eos_token_id}
        return ServedModel(
            spec,
            device=device,
            tokenizer=tok,
            max_model_len=self.max_model_len,
            max_kv_tokens=self.max_kv_tokens,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos,
            grammars=Grammars(tok, cfg.vocab_size, eos),
        )


class _Placement:
    """The loader's `place` callbacks of one build: each packs the tensors of a model (or of one
    shard) into a WeightBuffer of a pool and maps it there. The buffers made are kept, in order,
    to close if the build fails; `evicted`: the idle models evicted for room."""

    def __init__(self) -> None:
        self.buffers: list[WeightBuffer] = []
        self.evicted: list[str] = []

    def placer(self, pool: PagePool, owner: str, short: str, make_room=None, reclaim=True):
        """short: the MemoryError's message when the pages are not there ({nbytes}: the
        weights' bytes); make_room(fits) -> evicted names: evict idle models first."""

        def place(tensors):
            wb = WeightBuffer(pool, owner, WeightLayout.pack(tensors), reclaim=reclaim)
            self.buffers.append(wb)
            if make_room is not None:
                self.evicted += make_room(wb.can_map)
            if not wb.map():
                raise MemoryError(short.format(nbytes=wb.nbytes))
            return wb.views()

        return place


def build_worker(
    spec: ModelSpec,
    dev: DeviceWorker,
    settings: LoadSettings,
    shards: tuple[DeviceWorker, ...] = (),
    moved: tuple[ModelWorker, HostCopy] | None = None,
) -> tuple[ModelWorker, Loaded]:
    """spec's model on dev (call on dev's engine thread): read from its source, its weights in
    dev's pool (idle models evicted if the pool needs their pages) and a host copy made; split
    over dev and `shards` when spec.tensor_parallel > 1 (each shard's weights in its device's
    pool, free pages only); or, `moved`: a model (its worker and host copy) detached from
    another device, its weights copied in from the host copy, its history carried over. On
    failure nothing it placed stays and the models it evicted are active again."""
    placed = _Placement()
    hosts: list[HostCopy] = []
    try:
        with _current(dev.device):
            if moved is not None:
                worker, loaded = _moved(spec, dev, settings, placed, *moved)
            elif shards:
                worker, loaded = _sharded(spec, dev, settings, shards, placed, hosts)
            else:
                worker, loaded = _single(spec, dev, settings, placed, hosts)
    except BaseException:
        for wb in placed.buffers:
            wb.close()
        for h in hosts:
            h.close()
        for name in placed.evicted:  # as it was before this build
            dev.memory.make_resident(dev.models[name], time.monotonic(), wait=True)
        raise
    return worker, loaded


def pinned_weight_pages(dev) -> dict[str, int]:
    """The weight pages of dev's pinned models: pages that never come back to its pool."""
    return {n: m.weights.num_pages for n, m in dev.models.items() if m.pinned and m.weights}


def _single(spec, dev, settings, placed: _Placement, hosts: list) -> tuple[ModelWorker, Loaded]:
    pool = dev.pool

    def room(fits) -> list[str]:
        evicted = dev.memory.make_room(fits, time.monotonic())
        if evicted and settings.all_resident:
            raise MemoryError(
                f"the static policy keeps every model resident, and {spec.name} does not "
                f"fit beside {', '.join(dev.models)}; raise pool_budget_bytes"
            )
        return evicted

    pinned = pinned_weight_pages(dev)
    beside = (  # pages that never come back
        f", {sum(pinned.values())} of them the weights of pinned {', '.join(pinned)}"
        if pinned
        else ""
    )
    short = (
        f"the page pool ({pool.capacity} pages of {pool.page_bytes} bytes{beside}) cannot hold "
        f"the {{nbytes}} bytes of {spec.name}'s weights; raise pool_budget_bytes"
    )
    dtype = spec.torch_dtype(dev.device)
    loaded = load_model(
        ModelSource.parse(resolve_source(spec.source)),
        dtype=dtype,
        device=dev.device,
        seed=spec.seed,
        cache_root=settings.cache_root,
        place=placed.placer(pool, f"{spec.name}/weights", short, make_room=room),
        quantization=spec.quantization,
    )
    sched = _scheduler_config(spec, settings, loaded.config.max_position_embeddings)
    (weights,) = placed.buffers
    hosts.append(HostCopy(weights.nbytes, dev.device))
    hosts[-1].save(weights.bytes())
    worker = _worker(
        spec, dev, settings, loaded.model, loaded.tokenizer, sched, dtype, weights, hosts[-1]
    )
    return worker, _loaded(worker, loaded.config, loaded.tokenizer, sched, placed.evicted)


def _sharded(spec, dev, settings, shards, placed: _Placement, hosts: list):
    devs = (dev, *shards)
    devices = [d.device for d in devs]
    dtype = spec.torch_dtype(dev.device)
    places = [
        placed.placer(
            d.pool,
            f"{spec.name}/weights" + (f".{rank}" if rank else ""),
            f"{d.name}'s page pool ({d.pool.num_available} pages free of {d.pool.capacity}) "
            f"cannot hold the {{nbytes}} bytes of shard {rank} of {spec.name}; load it first, "
            "or raise pool_budget_bytes",
            reclaim=rank == 0,  # the other devices' pools give free pages only
        )
        for rank, d in enumerate(devs)
    ]
    loaded = load_shards(
        ModelSource.parse(resolve_source(spec.source)),
        devices,
        places,
        dtype=dtype,
        seed=spec.seed,
        cache_root=settings.cache_root,
        quantization=spec.quantization,
    )
    sched = _scheduler_config(spec, settings, loaded.config.max_position_embeddings)
    for wb, device in zip(placed.buffers, devices):
        hosts.append(HostCopy(wb.nbytes, device))
        hosts[-1].save(wb.bytes())
    worker = _worker(
        spec,
        dev,
        settings,
        TensorParallel(loaded.shards, devices),
        loaded.tokenizer,
        sched,
        dtype,
        ShardedWeights(placed.buffers),
        host=ShardedHostCopy(hosts),
        profile=False,
        shard_pools=[d.pool for d in shards],
        shard_devices=[d.name for d in shards],
    )
    return worker, _loaded(worker, loaded.config, loaded.tokenizer, sched, [])


def _moved(spec, dev, settings, placed: _Placement, old: ModelWorker, host: HostCopy):
    model0 = old.runner.model
    dtype = old.kv.layout.dtype  # the compute dtype (FP8 weights keep their own)
    short = f"{dev.name} has not the pages of {spec.name}'s weights"
    place = placed.placer(dev.pool, f"{spec.name}/weights", short)
    model = empty_model(model0.config, dtype, dev.device, place, spec.quantization)
    host.retarget(dev.device)
    start = time.perf_counter()
    host.load(placed.buffers[0].bytes())
    took = time.perf_counter() - start
    sched, tok = old.scheduler.config, old.outputs.tokenizer
    worker = _worker(
        spec,
        dev,
        settings,
        model,
        tok,
        sched,
        old.kv.layout.dtype,
        placed.buffers[0],
        host=host,
        profile=False,  # its latency model comes with its history (inherit)
    )
    worker.inherit(old)
    worker.count_activation(took)  # (its weights came in from the host copy, as they do then)
    return worker, _loaded(worker, model0.config, tok, sched, [])


def _worker(
    spec, dev, settings, model, tokenizer, sched, dtype, weights, host=None, profile=True, **kw
) -> ModelWorker:
    """The worker of spec's model on dev, its weights (and host copy) given (profile: its
    latency profile now, within the budget; kw: a split model's other shards' pools and
    devices, as assemble_worker takes them)."""
    return assemble_worker(
        spec.name,
        model,
        tokenizer,
        dev.pool,
        sched,
        dtype,
        spec.max_cached_pages,
        weights=weights,
        host=host,
        pinned=spec.pinned or settings.all_resident,
        keep_alive_s=spec.keep_alive_s,
        resources=dev.resources,
        ttft_slo_s=spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None,
        tpot_slo_s=spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None,
        profile_budget_s=settings.profile_budget_s if profile else 0.0,
        **kw,
    )


def _scheduler_config(spec: ModelSpec, settings: LoadSettings, max_position_embeddings: int):
    return spec.scheduler_config(
        max_position_embeddings, settings.reserve_output_tokens, settings.enable_prefix_caching
    )


def _loaded(worker: ModelWorker, config, tokenizer, sched, evicted) -> Loaded:
    return Loaded(config, tokenizer, sched.max_model_len, worker.max_kv_tokens, tuple(evicted))


def _current(device: torch.device):
    """A context in which `device` is the current CUDA device (graphs are captured and streams
    made on the current one); nothing on the host."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
