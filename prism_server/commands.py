"""The typed messages other threads send a device worker (its only inbox). Each is handled on the
worker's thread between steps, in the order sent."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.request import Request

if TYPE_CHECKING:
    from prism_server.model_worker import ModelWorker


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


@dataclass(frozen=True)
class AddModel:
    worker: ModelWorker


@dataclass(frozen=True)
class RemoveModel:
    """Abort the model's requests, release its pages and drop it."""

    model: str


@dataclass(frozen=True)
class Activate:
    """Make the model resident (evicting idle ones if the pool needs their pages). `done`
    resolves once it serves, or with TransitionRefused."""

    model: str
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Evict:
    """Offload the model: running requests may finish for up to drain_s seconds, the rest go
    back to its queue. `done` resolves once it is offloaded, or with TransitionRefused."""

    model: str
    drain_s: float = 0.0
    done: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Call:
    """Run fn on the worker's thread (integrity checks, tests); its result or exception goes to
    `result`."""

    fn: Callable[[], Any]
    result: Future = field(default_factory=Future)


Command = Submit | Abort | AddModel | RemoveModel | Activate | Evict | Call


class TransitionRefused(RuntimeError):
    """An activation or eviction that cannot be done now (pinned, or no room even after
    evicting every idle model)."""
