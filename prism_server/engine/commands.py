"""The typed messages other threads send a device worker (its only inbox). Each is handled on the
worker's thread between steps, in the order sent. A command with a `done` future is answered
through it: its result, or the error its handling raised (TransitionRefused for a transition
that cannot be done now); the others are fire and forget."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.request import Request

if TYPE_CHECKING:
    from kvpool import HostBudget, HostCopy, PagePool
    from prism_server.config import ModelSpec
    from prism_server.engine.device_worker import DeviceWorker
    from prism_server.engine.loading import LoadSettings
    from prism_server.engine.model_worker import ModelWorker


# ---- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """Queue a request on a model of this device (already checked by its ServedModel)."""

    model: str
    request: Request


@dataclass(frozen=True)
class Abort:
    """Finish a request now (client gone, shutdown); its blocks are freed. Unknown ids: no-op."""

    model: str
    request_id: str


# ---- loading and moving models -------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """Build `spec`'s model on this device (loading.build_worker) and serve it here. `shards`:
    the other devices of a model split over several (it maps its shards' weights in their
    pools). `done` -> loading.Loaded (what the frontend keeps of it)."""

    spec: ModelSpec
    settings: LoadSettings
    shards: tuple[DeviceWorker, ...] = ()
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Detach:
    """Take an offloaded model off this device to move it to device `dst`, if it can leave now
    and `room` (dst's pool) has its weight pages free. `done` -> (its worker, its host copy), or
    None (it stays)."""

    model: str
    dst: str
    room: PagePool
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Migrate:
    """Build a model detached from another device here, from its host copy (its history
    carried over), and serve it here. `done` -> its max_kv_tokens here, or the error (it is not
    here)."""

    spec: ModelSpec
    settings: LoadSettings
    old: ModelWorker
    host: HostCopy
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class RemoveModel:
    """Abort the model's requests, release its pages and drop it."""

    model: str
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Partition:
    """The static policy: split the pool's room beside the weights into equal, fixed KV quotas
    for this device's models (MemoryError: no room). `done` -> {model: its max_kv_tokens}."""

    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class KVReach:
    """How long a sequence each model of this device can ever hold: its KV's pages, the pool's
    but for its own weights and those of the pinned models, which never leave (every Load and
    Migrate caps them so). `done` -> {model: its max_kv_tokens}."""

    done: Future = field(default_factory=Future)


# ---- LoRA adapters -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadAdapter:
    """Read the LoRA adapter in directory `path` for the model `base` of this device (checked
    against its shapes and `max_rank`: models.lora.AdapterError), place its weights in the pool
    (its own owner) with a host copy, and serve it by the base's steps (`num_slots`: the base's
    adapter slots, fixed by its first adapter). `done` -> its rank."""

    base: str
    name: str
    path: str
    max_rank: int
    num_slots: int
    host: HostBudget | None = None  # what its host copy takes from (MemoryError past it)
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class UnloadAdapter:
    """Drop an adapter of `base` once its requests have finished (the frontend sends it no new
    ones): its slot, pages and host copy. `done` resolves once it is gone."""

    base: str
    name: str
    done: Future = field(default_factory=Future)


# ---- residency -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Activate:
    """Make the model resident (evicting idle ones if the pool needs their pages). `done`
    resolves once it serves, or with TransitionRefused."""

    model: str
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Evict:
    """Offload the model: running requests may finish for up to drain_s seconds, the rest go
    back to its queue. `done` resolves once it is offloaded, or with TransitionRefused (pinned,
    or activated while it drained)."""

    model: str
    drain_s: float = 0.0
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class PlanEvict:
    """The control loop's move: evict a resident model the plan offloads, if it is still idle.
    `done` -> whether it was evicted."""

    model: str
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Prefetch:
    """The control loop's move: activate an offloaded model the plan places, ahead of its next
    request, if it left for room and its pages are free. `done` -> whether it started."""

    model: str
    done: Future = field(default_factory=Future)


# ---- between devices (a model split over several) ------------------------------------------------
@dataclass(frozen=True)
class MakeFree:
    """Another device asks: make `pages` pages of this pool free for a shard of `taker`, a model
    it steps (other models' reserves first, then idle models). Not waited for."""

    pages: int
    taker: str
    now: float
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class ReleaseShards:
    """Another device (`device`), short of pages, asks: evict this device's idle models split
    over it; none idle and a taker named, one busy one gives up a request. `done` -> the names
    evicted."""

    device: str
    now: float
    taker: str | None = None
    done: Future = field(default_factory=Future)


# ---- state ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """Publish a snapshot now (after the step in progress). `done` -> the DeviceSnapshot."""

    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class CheckIntegrity:
    """Check every model's KV accounting (call when the device is idle)."""

    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Call:
    """Run fn on the worker's thread (tests and benchmarks only); `done` -> its result."""

    fn: Callable[[], Any]
    done: Future = field(default_factory=Future)


Command = (
    Submit
    | Abort
    | Load
    | Detach
    | Migrate
    | RemoveModel
    | LoadAdapter
    | UnloadAdapter
    | Partition
    | KVReach
    | Activate
    | Evict
    | PlanEvict
    | Prefetch
    | MakeFree
    | ReleaseShards
    | Publish
    | CheckIntegrity
    | Call
)


class TransitionRefused(RuntimeError):
    """An activation or eviction that cannot be done now (pinned, no room even after evicting
    every idle model, or activated while its eviction drained)."""
