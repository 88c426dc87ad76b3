"""The engine thread of one device. It owns every model on the device and the only way in is its
inbox of typed commands (commands.py); the only way out is the request sinks and the immutable
DeviceSnapshot it publishes after each step, so the event loop never blocks on model work and
never reads the thread's live objects."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from kvpool import PagePool
from prism_server.commands import (
    Abort,
    Activate,
    AddModel,
    Call,
    Command,
    Evict,
    RemoveModel,
    Submit,
    TransitionRefused,
)
from prism_server.model_runner import DeviceResources
from prism_server.model_worker import ModelWorker
from scheduler.snapshot import DeviceSnapshot, PoolSnapshot, Residency

log = logging.getLogger(__name__)

# How long to sleep when some model has work it cannot schedule yet (blocked on memory), and
# between polls of an activation's copy when nothing else runs.
_BLOCKED_POLL_S = 0.005
_TRANSFER_POLL_S = 0.0005


class DeviceWorker:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.device = pool.backend.device
        self.models: dict[str, ModelWorker] = {}  # engine thread only
        self.resources = DeviceResources(self.device)  # shared by its models' runners
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._seq = 0
        self._thread = threading.Thread(
            target=self._loop, name=f"prism-engine-{self.device}", daemon=True
        )
        self.snapshot = self._take_snapshot()  # replaced (never mutated) after every step

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    # ---- thread-safe entry points ---------------------------------------------------------------
    def send(self, cmd: Command) -> None:
        """Queue a command for the engine thread (returns at once)."""
        self._inbox.put(cmd)
        self._wake.set()

    def execute(self, cmd: Command) -> None:
        """Handle a command on the engine thread and wait for it (errors are raised here); for a
        transition (Activate, Evict), until it is done."""
        self.call(lambda: self._handle(cmd))
        done = getattr(cmd, "done", None)
        if done is not None:
            while not self._thread.is_alive() and not done.done():
                self.step()  # no thread (tests): move the transition on here
                time.sleep(_TRANSFER_POLL_S)
            done.result()

    def call(self, fn) -> Any:
        """Run fn on the engine thread (here, if it is not running) and return its result."""
        if not self._thread.is_alive():
            return fn()
        cmd = Call(fn)
        self.send(cmd)
        return cmd.result.result()

    def snapshot_now(self) -> DeviceSnapshot:
        """A snapshot published now, by the engine thread (after the step in progress)."""
        return self.call(self._publish)

    # ---- the loop -------------------------------------------------------------------------------
    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, Submit):
            self.models[cmd.model].add(cmd.request)
        elif isinstance(cmd, Abort):
            if cmd.model in self.models:
                self.models[cmd.model].abort(cmd.request_id)
        elif isinstance(cmd, AddModel):
            if cmd.worker.name in self.models:
                raise ValueError(f"a model named {cmd.worker.name!r} is already on {self.device}")
            self.models[cmd.worker.name] = cmd.worker
        elif isinstance(cmd, RemoveModel):
            self.models.pop(cmd.model).close()
        elif isinstance(cmd, Activate):
            m = self.models[cmd.model]
            if self.make_resident(m, time.monotonic()):
                m.when(Residency.RESIDENT, cmd.done)
            else:
                cmd.done.set_exception(
                    TransitionRefused(
                        f"`{cmd.model}` does not fit on {self.device} even with every idle model "
                        "evicted; retry when others are idle"
                    )
                )
        elif isinstance(cmd, Evict):
            m = self.models[cmd.model]
            if m.residency.on_device and not m.evictable:
                cmd.done.set_exception(
                    TransitionRefused(f"`{cmd.model}` is pinned: it is never evicted")
                )
            else:
                m.evict(cmd.drain_s)
                m.when(Residency.OFFLOADED, cmd.done)
        elif isinstance(cmd, Call):
            if cmd.result.set_running_or_notify_cancel():
                try:
                    cmd.result.set_result(cmd.fn())
                except BaseException as e:
                    cmd.result.set_exception(e)
        else:
            raise TypeError(f"not a command: {cmd!r}")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(cmd)
            except Exception:
                log.exception("engine command %s failed", type(cmd).__name__)

    # ---- residency (a simple policy: the control plane replaces it) ---------------------------
    def make_room(self, fits, now: float, keep: frozenset[str] = frozenset()) -> list[str]:
        """Evict idle models, least recently used first, until `fits()`; never one with
        requests, a pinned one, or one in `keep`. Returns the evicted names (fits() may still be
        false when nothing else could go)."""
        evicted: list[str] = []
        idle = sorted(
            (
                m
                for m in self.models.values()
                if m.resident and m.evictable and not m.requests and m.name not in keep
            ),
            key=lambda m: m.last_used,
        )
        for m in idle:
            if fits():
                break
            m.evict()
            evicted.append(m.name)
            log.info("evicted %s for room", m.name)
        return evicted

    def make_resident(self, m: ModelWorker, now: float, wait: bool = False) -> bool:
        """Start m's activation, evicting idle models if the pool needs their pages; False if
        it cannot have them now. wait: return once it serves."""
        if not m.can_activate():
            self.make_room(m.can_activate, now, keep=frozenset({m.name}))
            if not m.can_activate():
                return False
        return m.activate(wait=wait)

    def step(self) -> bool:
        """Moves every model's transition on, starts the activation of offloaded models that
        have work, and steps each serving model that has work once; True if any ran a batch.
        An activation's copy runs while the other models step."""
        ran = False
        now = time.monotonic()
        for m in list(self.models.values()):
            try:
                m.poll()
                if not m.has_work:
                    continue
                if m.residency is Residency.OFFLOADED and not self.make_resident(m, now):
                    continue  # no room yet: its requests wait
                if m.serving:
                    ran |= m.step(now)
            except Exception as e:  # a broken model must not stop the device's thread
                log.exception("model %s failed outside its batch", m.name)
                m.fail_all(f"{type(e).__name__}: {e}")
                ran = True
        return ran

    def _take_snapshot(self) -> DeviceSnapshot:
        s = self.pool.stats()
        self._seq += 1
        return DeviceSnapshot(
            device=str(self.device),
            seq=self._seq,
            time=time.monotonic(),
            pool=PoolSnapshot(s.page_bytes, s.capacity, s.created, s.free, sum(s.owned.values())),
            models=tuple(m.snapshot() for m in self.models.values()),
        )

    def _publish(self) -> DeviceSnapshot:
        self.snapshot = snap = self._take_snapshot()
        return snap

    def _expire(self, now: float) -> float | None:
        """Evict models idle past their keep-alive; returns the next such deadline."""
        nxt = None
        for m in self.models.values():
            until = m.idle_until()
            if until is None:
                continue
            if until <= now:
                try:
                    m.evict()
                    log.info("evicted %s: idle past its keep-alive", m.name)
                except Exception:
                    log.exception("keep-alive eviction of %s failed", m.name)
            else:
                nxt = until if nxt is None else min(nxt, until)
        return nxt

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # once, for this thread
        while not self._stop:
            self._wake.clear()
            self._drain()
            ran = self.step()
            expiry = self._expire(time.monotonic())
            self._publish()
            if ran:
                continue
            timeout = None
            if any(m.residency is Residency.ACTIVATING for m in self.models.values()):
                timeout = _TRANSFER_POLL_S
            elif any(m.has_work or m.residency is Residency.DRAINING for m in self.models.values()):
                timeout = _BLOCKED_POLL_S
            if expiry is not None:
                left = max(expiry - time.monotonic(), 0.0)
                timeout = left if timeout is None else min(timeout, left)
            self._wake.wait(timeout=timeout)
        self._drain()
        self._publish()
