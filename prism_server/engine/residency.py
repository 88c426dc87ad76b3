"""Residency of one model on its device (scheduler.snapshot.Residency): offloaded -> activating
-> resident -> draining -> offloaded.

Activate = map the weight pages (one batched call) + start the chunked host-to-device copy; the
engine thread goes on stepping other models and the model serves once every byte has landed.
Evict = admit nothing new, let running requests finish for up to the drain time, requeue the rest
(they recompute after the next activation), give every KV page back, unmap the weights (no copy:
the host copy is the source of truth). The model object, its CUDA graphs and attention state are
kept: addresses never change. Each transition is all or nothing: a failed copy leaves the model
offloaded."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from concurrent.futures import Future

from kvpool import HostCopy, PagedKV, ShardedKV, Transfer, WeightBuffer, map_and_load
from prism_server.engine.commands import TransitionRefused
from scheduler.batch_scheduler import BatchScheduler
from scheduler.request import Request
from scheduler.snapshot import ACTIVATION_BUCKETS, Residency

log = logging.getLogger(__name__)

TRANSITION_LOG = 64  # residency changes a snapshot carries
# How soon a device's loop looks again when no step ran: while some model's work cannot be
# scheduled yet (blocked on memory) or drains, and between polls of a copy in flight
BLOCKED_POLL_S = 0.005
TRANSFER_POLL_S = 0.0005


class ModelResidency:
    """The residency half of a ModelWorker: its state, the transitions and their counters.

    It drives the worker's `scheduler` (admission), `kv` (every page back on offload) and
    `requests`, and calls `flush_outputs` and `_settle_shards` before its pages go: the worker
    provides them. Engine thread only."""

    name: str
    scheduler: BatchScheduler
    kv: PagedKV | ShardedKV
    requests: dict[str, Request]

    def __init__(
        self,
        weights: WeightBuffer | None,
        host: HostCopy | None,
        pinned: bool,
        keep_alive_s: float | None,
    ):
        """weights / host: the model's parameters live in `weights` (mapped now) and `host` holds
        their copy; without them the model cannot be evicted (tests, benchmarks)."""
        self.weights, self.host, self.pinned = weights, host, pinned
        self.keep_alive_s = keep_alive_s
        self.residency = Residency.RESIDENT
        self.state_since = self.last_used = time.monotonic()
        # the latest residency changes (time entered, state): the status view's timeline
        self.transitions: deque[tuple[float, Residency]] = deque(
            [(self.state_since, self.residency)], maxlen=TRANSITION_LOG
        )
        self.activations = self.evictions = self.bytes_activated = 0
        self.activation_seconds = 0.0
        self.activation_buckets = [0] * len(ACTIVATION_BUCKETS)
        self.last_activation_s: float | None = None
        self.last_eviction_s: float | None = None
        self.evicted_for: str | None = None  # why it was last evicted (None: resident since)
        self._transfer: Transfer | None = None  # the copy of an activation in flight
        self._activation_started = self._evict_started = self._drain_until = 0.0
        self._waiters: dict[Residency, list[Future]] = {}  # admin transitions waiting for a state

    @property
    def resident(self) -> bool:
        return self.residency is Residency.RESIDENT

    @property
    def serving(self) -> bool:
        """Whether it runs batches (resident, or draining its running requests)."""
        return self.residency in (Residency.RESIDENT, Residency.DRAINING)

    @property
    def evictable(self) -> bool:
        return self.weights is not None and self.host is not None and not self.pinned

    def idle_until(self, keep_alive_s: float | None = None) -> float | None:
        """When its keep-alive (or the given one) runs out: it is then evicted although nothing
        needs its pages; None if that never happens now."""
        keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        if keep is None or not self.resident or not self.evictable or self.requests:
            return None
        return self.last_used + keep

    def when(self, state: Residency, done: Future) -> None:
        """Resolve `done` (with None) when the model is next in `state` (now if it is); a failed
        transition sets the error instead."""
        if self.residency is state:
            done.set_result(None)
        else:
            self._waiters.setdefault(state, []).append(done)

    def _enter(self, state: Residency) -> None:
        self.residency = state
        self.state_since = time.monotonic()
        self.transitions.append((self.state_since, state))
        for done in self._waiters.pop(state, ()):
            if not done.done():
                done.set_result(None)

    def _fail_waiters(self, error: BaseException, state: Residency | None = None) -> None:
        """Fail the transitions waiting for `state` (None: for any state) with `error`."""
        for waiting in list(self._waiters) if state is None else [state]:
            for done in self._waiters.pop(waiting, ()):
                if not done.done():
                    done.set_exception(error)

    def evict(self, drain_s: float = 0.0) -> None:
        """Start offloading: nothing new is admitted, running requests may finish for up to
        `drain_s` seconds, then the rest go back to the queue and every page goes back to the
        pool (at once if nothing runs or drain_s is 0; else in `poll`)."""
        if self.residency in (Residency.OFFLOADED, Residency.FAILED):
            return
        if not self.evictable:
            raise RuntimeError(f"model {self.name} cannot be evicted")
        if self.residency is Residency.ACTIVATING:
            self._land()  # the copy cannot be stopped half way: let it finish
        now = time.monotonic()
        if self.residency is Residency.RESIDENT:
            self._evict_started, self._drain_until = now, now + drain_s
            self.scheduler.admitting = False
            self._enter(Residency.DRAINING)
        else:  # draining already: the sooner deadline wins
            self._drain_until = min(self._drain_until, now + drain_s)
        self.poll()

    def poll(self) -> None:
        """Moves a transition on: activating -> resident once every byte has landed; draining ->
        offloaded once nothing runs or its drain time is up."""
        if self.residency is Residency.ACTIVATING and self._transfer.done():
            self._land()
        elif self.residency is Residency.DRAINING and (
            not self.scheduler.running or time.monotonic() >= self._drain_until
        ):
            self._offload()

    def _offload(self) -> None:
        self.flush_outputs()
        self.scheduler.preempt_all()
        self._settle_shards()
        self.kv.allocator.release_all()
        self.weights.unmap()
        self.scheduler.admitting = True
        self.evictions += 1
        self.last_eviction_s = time.monotonic() - self._evict_started
        self._enter(Residency.OFFLOADED)

    def can_activate(self) -> bool:
        return self.residency.on_device or self.weights.can_map()

    def activate(self, wait: bool = True) -> bool:
        """Map the weight pages and start the copy of the host copy into them; False (still
        offloaded, nothing taken) if the pool cannot give the pages now. A draining model goes
        back to resident. wait: return once every byte has landed (else `poll` finishes it)."""
        if self.residency is Residency.DRAINING:
            self.scheduler.admitting = True
            # an eviction waiting for this drain to end will not end: it is refused now
            self._fail_waiters(
                TransitionRefused(f"`{self.name}` was activated while draining"),
                Residency.OFFLOADED,
            )
            self._enter(Residency.RESIDENT)
        if self.residency is Residency.OFFLOADED:
            self._activation_started = time.perf_counter()
            self._transfer = map_and_load(self.weights, self.host)
            if self._transfer is None:
                return False
            self._enter(Residency.ACTIVATING)
        if self.residency is Residency.ACTIVATING and wait:
            self._land()
        return self.residency.on_device

    def _land(self) -> None:
        """Finish the activation (waits for the last byte if need be)."""
        transfer, self._transfer = self._transfer, None
        try:
            transfer.wait()
        except BaseException as e:  # all or nothing: back to offloaded
            self.weights.unmap()
            self._enter(Residency.OFFLOADED)
            self._fail_waiters(e)
            raise
        took = time.perf_counter() - self._activation_started
        self.count_activation(took)
        self.last_used = time.monotonic()
        self.evicted_for = None
        self._enter(Residency.RESIDENT)
        log.info("activated %s in %.3f s", self.name, took)

    def count_activation(self, took: float) -> None:
        """One more activation of `took` seconds: its weights copied in from the host copy (an
        activation's copy, or a move's to this device)."""
        self.activations += 1
        self.activation_seconds += took
        self.last_activation_s = took
        self.activation_buckets[bisect.bisect_left(ACTIVATION_BUCKETS, took)] += 1
        self.bytes_activated += self.weights.nbytes

    def leave_device(self) -> HostCopy:
        """An offloaded model with no request gives back everything it holds on its device (its
        KV range, its weight range) and hands over its host copy: it moves to another device.
        This worker is done with."""
        assert self.residency is Residency.OFFLOADED and not self.requests, self.residency
        self._fail_waiters(RuntimeError(f"model {self.name} moved to another device"))
        self.kv.close()
        self.weights.close()
        host, self.host = self.host, None
        return host

    def inherit_residency(self, old: ModelResidency) -> None:
        """Take over the activation counters and residency timeline of the worker this model had
        on another device."""
        for name in (
            "activations",
            "evictions",
            "bytes_activated",
            "activation_seconds",
            "activation_buckets",
            "last_activation_s",
            "last_eviction_s",
        ):
            setattr(self, name, getattr(old, name))
        self.transitions = deque([*old.transitions, *self.transitions], maxlen=TRANSITION_LOG)

    def close_residency(self) -> None:
        """Waits for an activation's copy (never free pages it still writes) and fails every
        admin transition waiting."""
        if self._transfer is not None:
            self._transfer.wait()
            self._transfer = None
        self._fail_waiters(RuntimeError(f"model {self.name} was removed"))
