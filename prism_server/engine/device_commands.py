"""What a device worker does for each command of its inbox (commands.py), on its engine thread.
`HANDLERS` maps each command type to a function of (the worker, the command); the worker gives
the function's result to the command's `done` future (a transition's once it is done)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from models.lora import read_adapter
from prism_server.engine.adapters import BaseAdapters
from prism_server.engine.commands import (
    Abort,
    Activate,
    Call,
    CheckIntegrity,
    Detach,
    Evict,
    KVReach,
    Load,
    LoadAdapter,
    MakeFree,
    Migrate,
    Partition,
    PlanEvict,
    Prefetch,
    Publish,
    ReleaseShards,
    RemoveModel,
    Submit,
    TransitionRefused,
    UnloadAdapter,
)
from prism_server.engine.loading import Loaded, build_worker, pinned_weight_pages
from prism_server.engine.model_worker import ModelWorker
from scheduler.policy import static_quota
from scheduler.snapshot import Residency

if TYPE_CHECKING:
    from prism_server.engine.device_worker import DeviceWorker

log = logging.getLogger(__name__)

# why an offloaded model left: only one that left for room may move or be prefetched (not one an
# admin or its keep-alive took off)
_LEFT_FOR_ROOM = ("evict", "plan", "preempt")


def load(w: DeviceWorker, cmd: Load) -> Loaded:
    if cmd.spec.name in w.models:
        raise ValueError(f"a model named {cmd.spec.name!r} is already on {w.device}")
    worker, loaded = build_worker(cmd.spec, w, cmd.settings, cmd.shards)
    w.add(worker)
    limit_reach(w)
    return replace(loaded, max_kv_tokens=worker.max_kv_tokens)


def detach(w: DeviceWorker, cmd: Detach) -> tuple[ModelWorker, object] | None:
    """Take an offloaded model off this device, to move it to `cmd.dst`, if it has no request,
    left for room and no transition is under way, and the other device has its weight pages
    free (moving evicts nobody); None otherwise (it stays). Its pages here go back to the pool;
    -> (the worker, its host copy), for Migrate on the other device."""
    m = w.models.get(cmd.model)
    if m is None or m.weights is None or cmd.room.num_available < m.weights.num_pages:
        return None
    if m.residency is not Residency.OFFLOADED or m.requests or not m.evictable:
        return None
    if m.evicted_for not in _LEFT_FOR_ROOM or not _planner_may_move(w):
        return None
    if m.adapters:  # its adapters' buffers are this pool's: it stays with them
        return None
    w.models.pop(cmd.model)
    log.info("moving %s from %s to %s", cmd.model, w.name, cmd.dst)
    return m, m.leave_device()


def migrate(w: DeviceWorker, cmd: Migrate) -> int:
    worker = build_worker(cmd.spec, w, cmd.settings, moved=(cmd.old, cmd.host))[0]
    w.add(worker)
    limit_reach(w)
    return worker.max_kv_tokens


def limit_reach(w: DeviceWorker) -> None:
    """Each model's KV capped at the pages it can ever map here: the pool's but for its own
    weights and the other pinned models' (they never leave), so that a request longer than that
    is refused when it comes (ServedModel.check) rather than waiting for pages that never come."""
    pinned = pinned_weight_pages(w)
    for m in w.models.values():
        others = sum(p for n, p in pinned.items() if n != m.name)
        if others and m.weights is not None and not m.shard_devices:
            m.kv.allocator.set_quota(max(0, w.pool.capacity - m.weights.num_pages - others))


def kv_reach(w: DeviceWorker, cmd: KVReach) -> dict[str, int]:
    return {n: m.max_kv_tokens for n, m in w.models.items()}


def load_adapter(w: DeviceWorker, cmd: LoadAdapter) -> int:
    """Read, check and place an adapter of a model of this device (AdapterError: a bad one,
    nothing placed); -> its rank."""
    m = w.models.get(cmd.base)
    if m is None:
        raise KeyError(f"no model {cmd.base!r} on {w.name}")
    adapter = read_adapter(cmd.path, m.runner.model, max_rank=cmd.max_rank, name=cmd.name)
    if m.adapters is None:

        def room(fits) -> list[str]:
            keep = frozenset({m.name})
            return w.memory.make_room(fits, time.monotonic(), keep=keep, taker=m.name)

        m.adapters = BaseAdapters(
            m.runner.model, cmd.num_slots, make_room=room, max_rank=cmd.max_rank
        )
        m.runner.lora = m.adapters
    m.adapters.add(adapter, w.pool, w.device, on_device=m.residency.on_device, host=cmd.host)
    return adapter.rank


def unload_adapter(w: DeviceWorker, cmd: UnloadAdapter) -> None:
    m = w.models.get(cmd.base)
    if m is None or m.adapters is None or cmd.name not in m.adapters:
        raise KeyError(f"no adapter {cmd.name!r} of {cmd.base!r} on {w.name}")
    m.unload_adapter(cmd.name, cmd.done)


def partition(w: DeviceWorker, cmd: Partition) -> dict[str, int]:
    """The static policy's fixed KV quotas, equal for every model of the device."""
    ws = list(w.models.values())
    quota = static_quota(w.pool.capacity, [m.weights.num_pages + m.adapter_pages for m in ws])
    if ws and quota < 1:
        raise MemoryError(
            f"the static policy needs every model resident with KV room: the weights of "
            f"{', '.join(w.models)} leave no page of the {w.pool.capacity} in the pool of {w.name}"
        )
    for m in ws:
        m.kv.allocator.set_quota(quota)
        m.kv.allocator.max_cached_pages = quota
    log.info("static partition on %s: %d KV pages for each of %d models", w.name, quota, len(ws))
    return {m.name: m.max_kv_tokens for m in ws}


def activate(w: DeviceWorker, cmd: Activate) -> None:
    m = w.models[cmd.model]
    if w.memory.make_resident(m, time.monotonic()):
        m.when(Residency.RESIDENT, cmd.done)
        return
    cmd.done.set_exception(
        TransitionRefused(
            f"`{cmd.model}` does not fit on {w.device} even with every idle model evicted; "
            "retry when others are idle"
        )
    )


def evict(w: DeviceWorker, cmd: Evict) -> None:
    m = w.models[cmd.model]
    if m.residency.on_device and not m.evictable:
        cmd.done.set_exception(TransitionRefused(f"`{cmd.model}` is pinned: it is never evicted"))
        return
    w.memory.evict(m, "admin", drain_s=cmd.drain_s)
    m.when(Residency.OFFLOADED, cmd.done)


def plan_evict(w: DeviceWorker, cmd: PlanEvict) -> bool:
    """Evict a resident model the plan offloads, if it is still idle."""
    m = w.models.get(cmd.model)
    if m is None or not m.resident or not m.evictable or m.requests:
        return False
    w.memory.evict(m, "plan")
    log.info("evicted %s: the plan gives its memory to models with demand", cmd.model)
    return True


def prefetch(w: DeviceWorker, cmd: Prefetch) -> bool:
    """Activate an offloaded model the plan places, ahead of its next request, if it left for
    room and the pool has its pages free."""
    m = w.models.get(cmd.model)
    if m is None or m.residency is not Residency.OFFLOADED:
        return False
    if m.evicted_for not in _LEFT_FOR_ROOM or not m.can_activate() or not _planner_may_move(w):
        return False
    log.info("prefetching %s: the plan places it and its pages are free", cmd.model)
    return m.activate(wait=False)


def _planner_may_move(w: DeviceWorker) -> bool:
    """Not under time sharing, and no starved model has the memory first."""
    return w.policy.max_resident is None and w.memory.taker is None


def check(w: DeviceWorker, cmd: CheckIntegrity) -> None:
    for m in w.models.values():
        m.check_integrity()


HANDLERS = {
    Submit: lambda w, cmd: w.models[cmd.model].add(cmd.request),
    Abort: lambda w, cmd: cmd.model in w.models and w.models[cmd.model].abort(cmd.request_id),
    Load: load,
    Detach: detach,
    Migrate: migrate,
    RemoveModel: lambda w, cmd: w.models.pop(cmd.model).close(),
    LoadAdapter: load_adapter,
    UnloadAdapter: unload_adapter,
    Partition: partition,
    KVReach: kv_reach,
    Activate: activate,
    Evict: evict,
    PlanEvict: plan_evict,
    Prefetch: prefetch,
    MakeFree: lambda w, cmd: w.memory.make_free(cmd.pages, cmd.taker, cmd.now),
    ReleaseShards: lambda w, cmd: w.memory.release_shards(cmd.device, cmd.now, cmd.taker),
    Publish: lambda w, cmd: w.publish(),
    CheckIntegrity: check,
    Call: lambda w, cmd: cmd.fn(),
}
