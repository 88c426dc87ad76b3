"""The engine thread of one device. It owns every model on the device and the only way in is its
inbox of typed commands (commands.py); the only way out is the request sinks and the immutable
DeviceSnapshot it publishes as it steps (at least every 5 ms while busy, and before it waits),
so the event loop never blocks on model work and never reads the thread's live objects."""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvpool import PagePool
from models.attention.flashinfer_paged import DEFAULT_KERNELS
from models.kernels.tuning import KernelConfig
from prism_server.engine.commands import (
    Activate,
    Call,
    CheckIntegrity,
    Command,
    Evict,
    Publish,
    UnloadAdapter,
)
from prism_server.engine.device_commands import HANDLERS
from prism_server.engine.device_memory import DeviceMemory
from prism_server.engine.model_runner import DeviceResources
from prism_server.engine.model_worker import ModelWorker
from prism_server.engine.residency import TRANSFER_POLL_S
from prism_server.engine.step_trace import StepTrace
from prism_server.engine.wait_causes import charge_device
from scheduler.balloon import admitting, may_activate
from scheduler.latency_model import StepShape
from scheduler.policy import POLICIES, Policy
from scheduler.snapshot import (
    DeviceSnapshot,
    EngineCounters,
    PageMove,
    PoolSnapshot,
    Residency,
)

log = logging.getLogger(__name__)

_PUBLISH_S = 0.005  # the most a busy device's snapshot lags its state


class DeviceWorker:
    def __init__(
        self,
        pool: PagePool,
        policy: Policy = POLICIES["prism"],
        name: str | None = None,
        trace: Path | None = None,
        kernels: KernelConfig = DEFAULT_KERNELS,
        enforce_eager: bool = False,
    ):
        self.pool = pool
        self.policy = policy
        self.device = pool.backend.device
        self.name = name or str(self.device)  # the device's name in snapshots and plans
        self.models: dict[str, ModelWorker] = {}  # engine thread only
        self.memory = DeviceMemory(self)  # carries out the balloon's decisions
        # host time between the end of one model step and the end of the next, less that step
        # (EWMA over busy stretches): what the arbitrator adds to every step it plans
        self.step_overhead_s = 0.0
        self._last_step_end: float | None = None
        # since start: model steps run, the seconds in them, the host seconds between
        # back-to-back ones (the device's utilisation and the engine's overhead, for the status)
        self.steps = 0
        self.step_seconds = self.host_seconds = 0.0
        # shared by the runners of the device's models
        self.resources = DeviceResources(self.device, kernels, enforce_eager)
        # the other devices of the engine, by name (a model split over devices asks them for
        # room for its shards); set by the engine once every device exists
        self.peers: dict[str, DeviceWorker] = {}
        self._launched: set[str] = set()  # the models whose step this engine step launched
        self._stepped: set[str] = set()  # the models whose step ran in this engine step
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._seq = 0
        self._thread = threading.Thread(
            target=self._loop, name=f"prism-engine-{self.name}", daemon=True
        )
        self.snapshot = self._take_snapshot()  # replaced (never mutated) as the steps run
        self._trace = StepTrace(trace, self.name) if trace is not None else None
        self._pick: tuple[Any, float] | None = None  # the pick being run and its arbitration's s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._trace is not None:
            self._trace.flush()

    # ---- thread-safe entry points ---------------------------------------------------------------
    def send(self, cmd: Command) -> None:
        """Queue a command for the engine thread (returns at once)."""
        self._inbox.put(cmd)
        self._wake.set()

    def execute(self, cmd: Command) -> Any:
        """Send a command with a `done` future and wait for its result (its error is raised
        here); for a transition (Activate, Evict), until it is done. With no thread (tests) it
        is handled here, and a transition moved on here."""
        if self._thread.is_alive():
            self.send(cmd)
        else:
            self._handle(cmd)
            while not cmd.done.done():
                self.step()
                time.sleep(TRANSFER_POLL_S)
        return cmd.done.result()

    def call(self, fn) -> Any:
        """Run fn on the engine thread (here, if it is not running) and return its result (tests
        and benchmarks; the engine sends typed commands)."""
        return self.execute(Call(fn)) if self._thread.is_alive() else fn()

    def snapshot_now(self) -> DeviceSnapshot:
        """A snapshot published now, by the engine thread (after the step in progress)."""
        return self.execute(Publish())

    def check_integrity(self) -> None:
        """The pool's and every model's KV accounting are exact (call when the device is idle)."""
        self.execute(CheckIntegrity())
        self.pool.check_integrity()

    # ---- the loop -------------------------------------------------------------------------------
    def _handle(self, cmd: Command) -> None:
        """Handle one command: its `done` future gets the handler's result (a transition's once
        the transition is done); a handler's error is raised."""
        done = getattr(cmd, "done", None)
        if done is not None and not done.set_running_or_notify_cancel():
            return  # cancelled before it ran
        handler = HANDLERS.get(type(cmd))
        if handler is None:
            raise TypeError(f"not a command: {cmd!r}")
        result = handler(self, cmd)
        if done is not None and not isinstance(cmd, (Activate, Evict, UnloadAdapter)):
            done.set_result(result)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(cmd)
            except Exception as e:  # to the command's future when it has one
                done = getattr(cmd, "done", None)
                if done is None or done.done():
                    log.exception("engine command %s failed", type(cmd).__name__)
                else:
                    done.set_exception(e)

    # ---- models ---------------------------------------------------------------------------------
    def add(self, worker: ModelWorker) -> None:
        """Serve `worker`'s model on this device (the Load and Migrate handlers)."""
        if worker.name in self.models:
            raise ValueError(f"a model named {worker.name!r} is already on {self.device}")
        self.models[worker.name] = worker
        if self._trace is not None:
            worker.on_step = self._trace_step

    def step(self) -> bool:
        """Moves every model's transition on, starts the activation of offloaded models that
        have work, and runs batches: the one the arbitrator picks (prism), or one of each
        serving model with work (round-robin baselines); True if any ran. An activation's copy
        runs while the other models step."""
        now = time.monotonic()
        self._launched = set()
        self._stepped = set()
        serving: list[ModelWorker] = []
        starved: list[ModelWorker] = []  # new work that waits for memory
        turn = self.policy.turn(self.memory.states)  # the offloaded models that may activate
        for m in list(self.models.values()):
            if turn is not None and m.residency is Residency.OFFLOADED and m.name not in turn:
                continue  # time sharing: not its turn
            if self._guard(m, lambda m=m: self._prepare(m, now)):
                serving.append(m)
            elif m.residency is Residency.OFFLOADED and m.has_work:
                starved.append(m)
        ran = False
        # while a model waits for memory for new work, the others admit nothing new, so the
        # pages the balloon frees go to it (to the taker, when one takes in turn)
        frozen = admitting(self.memory.starved, self.memory.taker)

        def admit(m: ModelWorker, order):
            return () if frozen and m.name not in frozen else order

        if serving and (len(serving) > 1 or serving[0].scheduler.waiting):
            pick = None
            try:
                t = time.perf_counter()
                work = lambda: [m.work() for m in serving]  # noqa: E731
                pick = self.policy.pick(work, now, self.step_overhead_s)
                self._pick = (pick, time.perf_counter() - t)
            except Exception:
                log.exception("the arbitrator failed: round-robin this step")
            if pick is not None:
                deferred = set(pick.deferred)
                for m in serving:
                    m.num_deferred = sum(r.request_id in deferred for r in m.scheduler.waiting)
                chosen = self.models[pick.model]
                order = admit(chosen, pick.admit)
                ran = self._timed(
                    chosen,
                    lambda: chosen.step(
                        now, order, pick.token_budget, while_running=self._hook(chosen)
                    ),
                )
            self._pick = None
        if not ran:  # round-robin (or the pick could not run: blocked on memory)
            for m in serving:
                ran |= self._timed(
                    m, lambda m=m: m.step(now, admit(m, None), while_running=self._hook(m))
                )
        self.memory.relieve(serving, starved, now)  # models blocked on memory: the balloon
        for m in self.models.values():  # adapters being unloaded whose last request ended
            if m.adapters:
                self._guard(m, m.reap_adapters)
        if not ran:  # no step to hide it behind: the last tokens' text now
            self.flush_outputs()
        # where each request's time went since its last charge (the idle wait before this step
        # included); models that admit nothing while another's new work waits count as blocked
        blocked = self.memory.starved
        if frozen:
            blocked = blocked | {m for m in self.models if m not in frozen}
        charge_device(self.models.values(), self._stepped, blocked, time.monotonic())
        return ran

    def flush_outputs(self, launched: frozenset[str] | set[str] = frozenset()) -> None:
        """Every model's tokens whose text is not made yet (a model's step leaves it to the
        device's next step, to do while the device runs it), those of steps launched ahead
        first, but for the steps of the models `launched` (this engine step's: still running)."""
        for m in self.models.values():
            self._guard(m, lambda m=m: m.flush_outputs(collect=m.name not in launched))

    def _hook(self, m: ModelWorker):
        """What the host does while m's step runs: every model's text so far."""
        self._launched.add(m.name)
        return lambda: self.flush_outputs(self._launched)

    def _timed(self, m: ModelWorker, fn) -> bool:
        """Runs one step of m (guarded) and accounts for it: the time in model steps, and the
        host time since the previous step ended when they run back to back."""
        start = time.perf_counter()
        ran = self._guard(m, fn)
        end = time.perf_counter()
        last, self._last_step_end = self._last_step_end, end if ran else None
        if not ran:
            return False
        self._stepped.add(m.name)
        self.steps += 1
        self.step_seconds += end - start
        if last is not None:
            gap = start - last  # the host work since the previous step ended
            if gap < 0.05:  # busy back to back (not an idle wait)
                self.host_seconds += gap
                self.step_overhead_s += 0.1 * (gap - self.step_overhead_s)
        return True

    def _trace_step(
        self, m: ModelWorker, start: float, shape: StepShape, estimate: float, took: float
    ) -> None:
        self._trace.record(m.name, start, shape, estimate, took, self._pick)

    def _prepare(self, m: ModelWorker, now: float) -> bool:
        """Moves m's transition on; True if it can step now."""
        m.poll()
        if not m.has_work:
            return False
        if m.residency is Residency.OFFLOADED:
            if not may_activate(m.name, self.memory.taker):
                return False  # another starved model has the memory first
            if not self.memory.make_resident(m, now):
                return False  # no room yet: its requests wait
        return m.serving

    def _guard(self, m: ModelWorker, fn) -> bool:
        try:
            return fn()
        except Exception as e:  # a broken model must not stop the device's thread
            log.exception("model %s failed outside its batch", m.name)
            m.fail_all(f"{type(e).__name__}: {e}")
            return False

    def _take_snapshot(self) -> DeviceSnapshot:
        s = self.pool.stats()
        self._seq += 1
        return DeviceSnapshot(
            device=self.name,
            seq=self._seq,
            time=time.monotonic(),
            pool=PoolSnapshot(s.page_bytes, s.capacity, s.created, s.free, sum(s.owned.values())),
            models=tuple(m.snapshot() for m in self.models.values()),
            policy=self.policy.name,
            moves=tuple(
                PageMove(mv.seq, mv.time, mv.giver, mv.taker, mv.pages, mv.reason)
                for mv in list(self.pool.moves)[-32:]
            ),
            moved=tuple(sorted((g, t, r, n) for (g, t, r), n in s.moved.items())),
            engine=EngineCounters(
                self.steps, self.step_seconds, self.host_seconds, self.step_overhead_s
            ),
        )

    def publish(self) -> DeviceSnapshot:
        self.snapshot = snap = self._take_snapshot()
        return snap

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # once, for this thread
        while not self._stop:
            self._wake.clear()
            self._drain()
            ran = self.step()
            now = time.monotonic()
            expiry = self.memory.expire(now)
            # back-to-back steps publish at most every _PUBLISH_S (a snapshot of every model
            # costs host time each step would pay); before it waits, always
            if not ran or now - self.snapshot.time >= _PUBLISH_S:
                self.publish()
            if ran:
                continue
            polls = (m.poll_after() for m in self.models.values())
            timeout = min(filter(None, polls), default=None)
            if expiry is not None:
                left = max(expiry - time.monotonic(), 0.0)
                timeout = left if timeout is None else min(timeout, left)
            self._wake.wait(timeout=timeout)
        self._drain()
        self.flush_outputs()  # the last step's text, for the streams still open
        self.publish()
