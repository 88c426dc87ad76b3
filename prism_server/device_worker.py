"""The engine thread of one device. It owns every model on the device and the only way in is its
inbox of typed commands (commands.py); the only way out is the request sinks and the immutable
DeviceSnapshot it publishes as it steps (at least every 5 ms while busy, and before it waits),
so the event loop never blocks on model work and never reads the thread's live objects."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from kvpool import PagePool
from models.attention.flashinfer_paged import DEFAULT_KERNELS, KernelChoice
from prism_server.commands import (
    Abort,
    Activate,
    Call,
    CheckIntegrity,
    Command,
    Detach,
    Evict,
    Load,
    Migrate,
    Partition,
    PlanEvict,
    Prefetch,
    Publish,
    RemoveModel,
    Submit,
    TransitionRefused,
)
from prism_server.loading import Loaded, build_worker
from prism_server.model_runner import DeviceResources
from prism_server.model_worker import ModelWorker
from scheduler.arbitrator import arbitrate
from scheduler.balloon import reclaim_order
from scheduler.latency_model import StepShape
from scheduler.policy import POLICIES, Policy, static_quota
from scheduler.snapshot import (
    DeviceSnapshot,
    EngineCounters,
    PageMove,
    PoolSnapshot,
    Residency,
)

log = logging.getLogger(__name__)

# How long to sleep when some model has work it cannot schedule yet (blocked on memory), and
# between polls of an activation's copy when nothing else runs.
_BLOCKED_POLL_S = 0.005
_NOBODY = object()  # a swap turn for no model
_TRANSFER_POLL_S = 0.0005
_PUBLISH_S = 0.005  # the most a busy device's snapshot lags its state


def _preempt_one(models: list[ModelWorker], why: str) -> tuple[ModelWorker, int] | None:
    """Preempt one running request of `models` for another model's new work: the one with the
    fewest computed tokens (the least to recompute) of those never preempted (a request goes
    once at most: takers in turn preempting each other's requests would finish none). Returns
    its model and the pages its KV unmapped (None: no such request)."""
    victims = [(r, o) for o in models for r in o.scheduler.running if r.num_preemptions == 0]
    for o in {id(o): o for _, o in victims}.values():
        o.sync()  # its step launched ahead may still write the victim's blocks
    victims = [(r, o) for r, o in victims if r.finish_reason is None and not r.is_finished]
    if not victims:
        return None
    req, owner = min(
        victims, key=lambda v: (v[0].num_computed_tokens, -v[0].arrival_time, v[0].request_id)
    )
    before = owner.kv.allocator.num_mapped_pages
    owner.scheduler.preempt(req)
    log.info("preempted %s of %s for %s", req.request_id, owner.name, why)
    return owner, before - owner.kv.allocator.num_mapped_pages


class DeviceWorker:
    def __init__(
        self,
        pool: PagePool,
        policy: Policy = POLICIES["prism"],
        name: str | None = None,
        trace: Path | None = None,
        kernels: KernelChoice = DEFAULT_KERNELS,
        launch_ahead: bool | None = None,
        piecewise: bool = True,
        piecewise_tokens: int | None = None,
        lanes: int = 1,
    ):
        """lanes: streams the device's models step on; models in different lanes step at once
        (the arbitrator's pick and, in each other lane, a model whose requests are decoding)."""
        self.pool = pool
        self.policy = policy
        self.device = pool.backend.device
        self.name = name or str(self.device)  # the device's name in snapshots and plans
        self.models: dict[str, ModelWorker] = {}  # engine thread only
        # the balloon: idle models' reserves go first; static partitions reclaim nothing
        pool.reclaim_order = self._reclaim_order if policy.balloon else None
        self._starved: frozenset[str] = frozenset()  # models whose new work waits for memory
        # the one starved model that may take memory from others (evict, preempt, activate) until
        # its new work runs: two starved models taking from each other would thrash
        self._taker: str | None = None
        # host time between the end of one model step and the end of the next, less that step
        # (EWMA over busy stretches): what the arbitrator adds to every step it plans
        self.step_overhead_s = 0.0
        self._last_step_end: float | None = None
        # since start: model steps run, the seconds in them, the host seconds between
        # back-to-back ones (the device's utilisation and the engine's overhead, for the status)
        self.steps = 0
        self.step_seconds = self.host_seconds = 0.0
        # shared by the runners of each lane's models; lane 0's are the device's
        self.resources = DeviceResources(
            self.device, kernels, launch_ahead, piecewise, piecewise_tokens
        )
        self.lanes = [self.resources] + [
            self.resources.lane_of_same_device(i) for i in range(1, max(1, lanes))
        ]
        self._lanes_given = 0
        # the other devices of the engine, by name (a model split over devices asks them for
        # room for its shards); set by the engine once every device exists
        self.peers: dict[str, DeviceWorker] = {}
        self._asked: dict[str, Future] = {}  # the last ask for room sent to each peer
        self.companion_steps = 0  # steps run at once with the pick, in another lane
        self._launched: set[str] = set()  # the models whose step this engine step launched
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._seq = 0
        self._thread = threading.Thread(
            target=self._loop, name=f"prism-engine-{self.name}", daemon=True
        )
        self.snapshot = self._take_snapshot()  # replaced (never mutated) as the steps run
        # the step trace (envs.step_trace): JSON lines, written in batches by the engine thread
        self._trace_path = None
        if trace is not None:
            self._trace_path = trace.with_name(f"{trace.name}.{self.name.replace(':', '')}")
            self._trace_path.write_text("")
        self._trace: list[str] = []
        self._pick: tuple[Any, float] | None = None  # the pick being run and its arbitration's s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._flush_trace()

    def _flush_trace(self) -> None:
        if self._trace_path is not None and self._trace:
            with self._trace_path.open("a") as f:
                f.write("".join(self._trace))
            self._trace.clear()

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
                time.sleep(_TRANSFER_POLL_S)
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
        handler = _HANDLERS.get(type(cmd))
        if handler is None:
            raise TypeError(f"not a command: {cmd!r}")
        result = handler(self, cmd)
        if done is not None and not isinstance(cmd, (Activate, Evict)):
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

    def _reclaim_order(self, usage, requester: str) -> list[str]:
        busy = frozenset(m.name for m in self.models.values() if m.requests)
        return reclaim_order(usage, requester, busy)

    # ---- residency ------------------------------------------------------------------------------
    def make_room(
        self,
        fits,
        now: float,
        keep: frozenset[str] = frozenset(),
        taker: str | None = None,
        limit: int | None = None,
        stalled: bool = False,
    ) -> list[str]:
        """Evict idle models, least recently used first, until `fits()` (at most `limit`);
        never one with requests (stalled: with running requests; one whose requests all wait
        for memory may go, they wait for its next activation), a pinned one, or one in `keep`.
        Returns the evicted names (fits() may still be false when nothing else could go)."""
        evicted: list[str] = []
        idle = sorted(
            (
                m
                for m in self.models.values()
                if m.resident
                and m.evictable
                and m.name not in keep
                and not (m.scheduler.running if stalled else m.requests)
            ),
            key=lambda m: m.last_used,
        )
        for m in idle:
            if fits() or (limit is not None and len(evicted) >= limit):
                break
            self._evict(m, "evict", taker)
            evicted.append(m.name)
            log.info("evicted %s for room", m.name)
        return evicted

    def _evict(
        self, m: ModelWorker, reason: str, taker: str | None = None, drain_s: float = 0.0
    ) -> None:
        """Evict m and log the pages it gives up (all it holds) as one move, with the reason."""
        on = m.residency.on_device
        pages = m.kv.allocator.num_mapped_pages + (m.weights.num_pages if on else 0)
        m.evict(drain_s)
        m.evicted_for = reason
        if on:
            self.pool.record_move(m.name, taker, pages, reason)

    # ---- the control loop's moves (PlanEvict, Prefetch; detach: Detach) ------------------------
    def plan_evict(self, name: str) -> bool:
        """Evict a resident model the plan offloads, if it is still idle."""
        m = self.models.get(name)
        if m is None or not m.resident or not m.evictable or m.requests:
            return False
        self._evict(m, "plan")
        log.info("evicted %s: the plan gives its memory to models with demand", name)
        return True

    def detach(self, name: str, dst: str) -> ModelWorker | None:
        """Take an offloaded model off this device, to move it to device `dst`, if it has no
        request, left for room (not by an admin or its keep-alive) and no transition is under
        way; None otherwise (it stays). Its pages here are given back; the caller builds it
        on the other device from the worker returned."""
        m = self.models.get(name)
        if m is None or m.residency is not Residency.OFFLOADED or m.requests:
            return None
        if m.evicted_for not in ("evict", "plan", "preempt") or not m.evictable:
            return None
        if self.policy.max_resident is not None or self._taker is not None:
            return None
        self.models.pop(name)
        log.info("moving %s from %s to %s", name, self.name, dst)
        return m

    def prefetch(self, name: str) -> bool:
        """Activate an offloaded model the plan places, ahead of its next request, if it left
        for room (not by an admin or its keep-alive) and the pool has its pages free."""
        m = self.models.get(name)
        if m is None or m.residency is not Residency.OFFLOADED:
            return False
        if m.evicted_for not in ("evict", "plan", "preempt") or not m.can_activate():
            return False
        if self.policy.max_resident is not None or self._taker is not None:
            return False  # time sharing, or a starved model has the memory first
        log.info("prefetching %s: the plan places it and its pages are free", name)
        return m.activate(wait=False)

    # ---- command handlers (on the engine thread; _HANDLERS maps each command to its own) -------
    def _on_submit(self, cmd: Submit) -> None:
        self.models[cmd.model].add(cmd.request)

    def _on_abort(self, cmd: Abort) -> None:
        if cmd.model in self.models:
            self.models[cmd.model].abort(cmd.request_id)

    def _on_load(self, cmd: Load) -> Loaded:
        if cmd.spec.name in self.models:
            raise ValueError(f"a model named {cmd.spec.name!r} is already on {self.device}")
        worker, loaded = build_worker(cmd.spec, self, cmd.settings, cmd.shards)
        self._add(worker)
        return loaded

    def _on_detach(self, cmd: Detach):
        m = self.models.get(cmd.model)
        if m is None or m.weights is None or cmd.room.num_available < m.weights.num_pages:
            return None  # the other device has not its weight pages free: moving evicts nobody
        old = self.detach(cmd.model, cmd.dst)
        return None if old is None else (old, old.leave_device())  # its pages here go back

    def _on_migrate(self, cmd: Migrate) -> None:
        self._add(build_worker(cmd.spec, self, cmd.settings, moved=(cmd.old, cmd.host))[0])

    def _add(self, worker: ModelWorker) -> None:
        if worker.name in self.models:
            raise ValueError(f"a model named {worker.name!r} is already on {self.device}")
        self.models[worker.name] = worker
        if self._trace_path is not None:
            worker.on_step = self._trace_step

    def _on_partition(self, cmd: Partition) -> dict[str, int]:
        ws = list(self.models.values())
        quota = static_quota(self.pool.capacity, [w.weights.num_pages for w in ws])
        if ws and quota < 1:
            raise MemoryError(
                f"the static policy needs every model resident with KV room: the weights of "
                f"{', '.join(self.models)} leave no page of the {self.pool.capacity} in the pool "
                f"of {self.name}"
            )
        for w in ws:
            w.kv.allocator.set_quota(quota)
            w.kv.allocator.max_cached_pages = quota
        log.info(
            "static partition on %s: %d KV pages for each of %d models", self.name, quota, len(ws)
        )
        return {w.name: w.max_kv_tokens for w in ws}

    def _on_activate(self, cmd: Activate) -> None:
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

    def _on_evict(self, cmd: Evict) -> None:
        m = self.models[cmd.model]
        if m.residency.on_device and not m.evictable:
            cmd.done.set_exception(
                TransitionRefused(f"`{cmd.model}` is pinned: it is never evicted")
            )
        else:
            self._evict(m, "admin", drain_s=cmd.drain_s)
            m.when(Residency.OFFLOADED, cmd.done)

    def _on_check(self, cmd: CheckIntegrity) -> None:
        for m in self.models.values():
            m.check_integrity()

    # ---- residency (continued) ------------------------------------------------------------------
    def make_resident(self, m: ModelWorker, now: float, wait: bool = False) -> bool:
        """Start m's activation, evicting idle models if the pool needs their pages; False if
        it cannot have them now. wait: return once it serves. A model split over devices has
        room made for each shard by the shard's own device (asked, not waited for: it is
        activated once every shard fits)."""
        if not m.can_activate():
            parts = getattr(m.weights, "parts", None)
            own = parts[0].can_map if parts else m.can_activate
            if not own():
                self.make_room(own, now, keep=frozenset({m.name}), taker=m.name)
            for device, part in zip(m.shard_devices, parts[1:] if parts else ()):
                if not part.can_map():
                    self._ask_for_room(device, part.num_pages, m.name, now)
            if not m.can_activate():
                self._ask_for_shards(now)
                return False
        return m.activate(wait=wait)

    def step(self) -> bool:
        """Moves every model's transition on, starts the activation of offloaded models that
        have work, and runs batches: the one the arbitrator picks (prism), or one of each
        serving model with work (round-robin baselines); True if any ran. An activation's copy
        runs while the other models step."""
        now = time.monotonic()
        self._launched = set()
        serving: list[ModelWorker] = []
        starved: list[ModelWorker] = []  # new work that waits for memory
        turn = self._swap_turn()
        for m in list(self.models.values()):
            if turn is not None and m.residency is Residency.OFFLOADED and m is not turn:
                continue  # time sharing: not its turn
            if self._guard(m, lambda m=m: self._prepare(m, now)):
                serving.append(m)
            elif m.residency is Residency.OFFLOADED and m.has_work:
                starved.append(m)
        ran = False
        # while a model waits for memory for new work, the others admit nothing new, so the
        # pages the balloon frees go to it (to the taker, when one takes in turn)
        frozen = self._starved if self._taker is None else frozenset({self._taker})

        def admit(m: ModelWorker, order):
            return () if frozen and m.name not in frozen else order

        if serving and self.policy.arbitrate and (len(serving) > 1 or serving[0].scheduler.waiting):
            pick = None
            try:
                t = time.perf_counter()
                pick = arbitrate([m.work() for m in serving], now, self.step_overhead_s)
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
                if ran and len(self.lanes) > 1:
                    self._companions(chosen, serving, now)
            self._pick = None
        if not ran:  # round-robin (or the pick could not run: blocked on memory)
            for m in serving:
                ran |= self._timed(
                    m, lambda m=m: m.step(now, admit(m, None), while_running=self._hook(m))
                )
        blocked = [m for m in serving if m.scheduler.blocked]
        starved += [m for m in blocked if m.scheduler.has_new_work]
        # only models the balloon can help: their pages exist once others' KV is freed
        starved = [m for m in starved if self._within_reach(m)]
        self._starved = frozenset(m.name for m in starved)
        self._taker = self._next_taker(starved) if self.policy.evict_for_kv else None
        self.pool.release_hold(keep=self._taker)  # pages held for a taker that took them or left
        if self.policy.evict_for_kv:
            for m in dict.fromkeys(starved + blocked):
                self._balloon(m, serving, starved, now)
        if not ran:  # no step to hide it behind: the last tokens' text now
            self.flush_outputs()
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

    def lane_for_new_model(self) -> DeviceResources:
        """The lane a model loaded now steps in: each in turn."""
        lane = self.lanes[self._lanes_given % len(self.lanes)]
        self._lanes_given += 1
        return lane

    def _companions(self, chosen: ModelWorker, serving: list[ModelWorker], now: float) -> None:
        """With several lanes: in each lane but chosen's, the model with requests running that
        stepped least recently steps too, at once with chosen on its lane's stream. It admits
        no one (who starts stays the arbitrator's call), and its step is decode-sized: a token
        per running request (a prefill chunk waits for the arbitrator's pick), so it does not
        slow chosen's step by much."""
        busy = {chosen.lane}
        for m in sorted(serving, key=lambda m: m.last_used):
            n = len(m.scheduler.running)
            if m.lane in busy or not n:
                continue
            busy.add(m.lane)
            if self._timed(m, lambda m=m, n=n: m.step(now, (), n, while_running=self._hook(m))):
                self.companion_steps += 1

    def _next_taker(self, starved: list[ModelWorker]) -> str | None:
        """The starved model that takes memory first. The current one keeps its turn while it
        has work and nothing of it runs (it activates, or the arbitrator has not stepped it
        since), or while it is starved; else a resident one (its activation is paid) before an
        offloaded one, then the one whose new request came first."""
        held = self.models.get(self._taker) if self._taker is not None else None
        if (
            held is not None
            and held.has_work
            and (held.name in self._starved or not held.scheduler.running)
        ):
            return held.name
        if not starved:
            return None

        def key(m: ModelWorker):
            new = [r.arrival_time for r in m.scheduler.waiting if r.first_scheduled_time is None]
            first = min(new or [r.arrival_time for r in m.requests.values()] or [float("inf")])
            return (not m.residency.on_device, first, m.name)

        return min(starved, key=key).name

    def _within_reach(self, m: ModelWorker) -> bool:
        """Whether m's next need (its weights if offloaded, and the KV of its first new request)
        is at most what the pool could give if every other model's KV pages and every idle
        model's weights came back."""
        a = m.kv.allocator
        waiting = m.scheduler.waiting
        first = next((r for r in waiting if r.first_scheduled_time is None), None)
        if first is None and waiting:  # a preempted request's recompute
            first = waiting[0]
        blocks = m.scheduler.blocks_needed(first.num_tokens + 1) if first is not None else 1
        need = -(-max(blocks - a.num_free_blocks, 0) // a.bpp)
        if m.residency is Residency.OFFLOADED:
            need += m.weights.num_pages
        reach = self.pool.available_to(m.name)
        for o in self.models.values():
            if o is m or not o.residency.on_device:
                continue
            reach += o.kv.allocator.num_mapped_pages
            if not o.requests and o.evictable and o.weights is not None:
                reach += o.weights.num_pages
        if self.peers:  # the KV of other devices' models split over this one (they preempt)
            owned = self.pool.stats().owned
            reach += sum(n for o, n in owned.items() if "/" not in o and o not in self.models)
        return need <= reach

    def _balloon(
        self, m: ModelWorker, serving: list[ModelWorker], starved: list[ModelWorker], now: float
    ) -> None:
        """The last resorts for m, which waits for pages the pool has not got (free pages and
        other models' reserves are gone): evict an idle or stalled model (least recently used;
        two stalled models must not wait for each other forever); else, for
        new work only, preempt one running request of a model that is not itself waiting for
        memory, the one with the fewest computed tokens (the least work to recompute). One move
        per step."""
        if m in starved and m.name != self._taker:
            return  # its turn comes when the taker's new work runs
        short = [  # a split model: its shards' devices whose pools have no page free
            d
            for d, c in zip(m.shard_devices, m.kv.caches[1:])
            if not c.pages.pool.available_to(m.name)
        ]
        for device in short:
            self._ask_for_room(device, 1, m.name, now)
        if short and self.pool.available_to(m.name):
            return  # the page it waits for is on those devices, not here
        keep = frozenset({m.name, self._taker} - {None})
        # a stalled model (all its requests wait for memory) goes for the taker, or for another
        # stalled model when no one takes (two must not wait for each other forever); not for a
        # running request's growth: the evicted model took the memory back as the next taker
        stalled = m.name == self._taker or (self._taker is None and not m.scheduler.running)
        if self.make_room(lambda: False, now, keep, m.name, limit=1, stalled=stalled):
            if self._taker is None:  # the pages it freed are its own until it runs: the model
                self._taker = m.name  # evicted (stalled too) must not take them straight back
            return
        new_work = m in starved and m.scheduler.has_new_work  # else a recompute or growth
        others = [o for o in serving if o is not m and o not in starved] if new_work else []
        got = _preempt_one(others, f"{m.name}'s new work")
        if got is not None:
            owner, freed = got
            self.pool.record_move(owner.name, m.name, freed, "preempt")
        # the other devices evict their idle models split over this one; for new work with no
        # request here to preempt, a busy one of them gives up a request instead
        self._ask_for_shards(now, taker=m.name if new_work and got is None else None)

    def _ask_for_room(self, device: str, pages: int, taker: str, now: float) -> None:
        """Ask another device to make `pages` pages of its pool free for `taker`, a model this
        device steps with a shard there (its shards map free pages only): that device's thread
        takes reserves back, then evicts idle models."""
        self._ask(device, lambda peer: peer.make_free(pages, taker, now))

    def _ask(self, device: str, fn) -> None:
        """Run fn(that device's worker) on another device's thread. Not waited for; one ask in
        flight a device."""
        peer, asked = self.peers.get(device), self._asked.get(device)
        if peer is None or (asked is not None and not asked.done()):
            return
        ask = Call(lambda: fn(peer))
        self._asked[device] = ask.done
        peer.send(ask)

    def _ask_for_shards(self, now: float, taker: str | None = None) -> None:
        """Short of pages with nothing of its own to evict: ask every other device to evict its
        idle models split over this one (their shards here hold pages this device's models
        cannot take otherwise); taker: a model of this device whose new work waits, for which
        a busy one gives up a request when none is idle."""
        stats = self.pool.stats()
        if any(n and o.split("/")[0] not in self.models for o, n in stats.owned.items()):
            for device in self.peers:
                self._ask(device, lambda peer: peer.release_shards(self.name, now, taker))

    def release_shards(self, device: str, now: float, taker: str | None = None) -> list[str]:
        """Evict this device's idle models split over `device` (asked by it: short of pages).
        None idle and a taker named: preempt one running request of a busy one (not itself
        waiting for memory; a request once at most, as for a model of the same device), its
        model's unused pages given back, and the pages that frees on `device` held there for
        the taker."""
        gone = []
        for m in list(self.models.values()):
            if device in m.shard_devices and m.resident and m.evictable and not m.requests:
                self._evict(m, "evict", f"{device} models")
                gone.append(m.name)
                log.info("evicted %s: %s needs the pages its shard holds there", m.name, device)
        if gone or taker is None:
            return gone
        busy = [
            m
            for m in self.models.values()
            if device in m.shard_devices and m.resident and m.name not in self._starved
        ]
        pools = {m.name: m.kv.caches[1 + m.shard_devices.index(device)].pages.pool for m in busy}
        before = {n: p.pages_of(n) for n, p in pools.items()}  # its reserve goes back too
        got = _preempt_one(busy, f"{taker} on {device}")
        if got is not None:
            owner = got[0]
            a = owner.kv.allocator
            a.reclaim_pages(a.reclaimable_pages())  # unmapped in every shard's pool
            pool = pools[owner.name]
            freed = before[owner.name] - pool.pages_of(owner.name)
            pool.hold_for(taker, freed)
            pool.record_move(owner.name, taker, freed, "preempt")
        return gone

    def make_free(self, pages: int, taker: str, now: float) -> None:
        """`pages` pages of this device's pool free for a shard of `taker`, a model another
        device steps (asked by it): other models' reserves first, then idle models, least
        recently used first."""
        if self.pool.free_up(pages, taker) < pages:
            self.make_room(lambda: self.pool.available_to(taker) >= pages, now, taker=taker)

    def _swap_turn(self) -> ModelWorker | None:
        """Under a cap on resident models: the offloaded model that may activate now (the one
        whose request has waited longest, once a place is free); None without a cap."""
        cap = self.policy.max_resident
        if cap is None:
            return None
        on = sum(m.residency.on_device for m in self.models.values())
        waiting = [
            m for m in self.models.values() if m.residency is Residency.OFFLOADED and m.has_work
        ]
        if on >= cap or not waiting:
            return _NOBODY
        return min(waiting, key=lambda m: min(r.arrival_time for r in m.requests.values()))

    def _timed(self, m: ModelWorker, fn) -> bool:
        """Runs one step of m (guarded) and accounts for it: the time in model steps, and the
        host time since the previous step ended when they run back to back."""
        start = time.perf_counter()
        with m.resources.stepping() if m.resources is not None else contextlib.nullcontext():
            ran = self._guard(m, fn)
        end = time.perf_counter()
        last, self._last_step_end = self._last_step_end, end if ran else None
        if not ran:
            return False
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
        """One line of the step trace for a step done (a step launched ahead is done once its
        tokens are read, in a later engine step): from when the device could start it."""
        rec: dict[str, Any] = {"t": start, "s": took, "model": m.name, "run_s": took}
        rec |= {"tokens": shape.tokens, "seqs": shape.seqs, "kv": shape.kv, "attn": shape.attn}
        rec["est_s"] = estimate
        if self._pick is not None and self._pick[0] is not None and self._pick[0].model == m.name:
            pick, arb_s = self._pick  # the arbitration of the engine step that reads it
            rec |= {"arb_s": arb_s, "budget": pick.token_budget, "admit": len(pick.admit)}
        self._trace.append(json.dumps(rec) + "\n")
        if len(self._trace) >= 1000:
            self._flush_trace()

    def _prepare(self, m: ModelWorker, now: float) -> bool:
        """Moves m's transition on; True if it can step now."""
        m.poll()
        if not m.has_work:
            return False
        if m.residency is Residency.OFFLOADED:
            if self._taker not in (None, m.name):
                return False  # another starved model has the memory first
            if not self.make_resident(m, now):
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

    def _publish(self) -> DeviceSnapshot:
        self.snapshot = snap = self._take_snapshot()
        return snap

    def _expire(self, now: float) -> float | None:
        """Evict models idle past their keep-alive; returns the next such deadline."""
        nxt = None
        for m in self.models.values():
            until = m.idle_until(0.0 if self.policy.evict_idle else None)
            if until is None:
                continue
            if until <= now:
                try:
                    self._evict(m, "keep-alive")
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
            now = time.monotonic()
            expiry = self._expire(now)
            # back-to-back steps publish at most every _PUBLISH_S (a snapshot of every model
            # costs host time each step would pay); before it waits, always
            if not ran or now - self.snapshot.time >= _PUBLISH_S:
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
        self.flush_outputs()  # the last step's text, for the streams still open
        self._publish()


# each command's handler, called with (the worker, the command) on the engine thread
_HANDLERS = {
    Submit: DeviceWorker._on_submit,
    Abort: DeviceWorker._on_abort,
    Load: DeviceWorker._on_load,
    Detach: DeviceWorker._on_detach,
    Migrate: DeviceWorker._on_migrate,
    RemoveModel: lambda w, cmd: w.models.pop(cmd.model).close(),
    Partition: DeviceWorker._on_partition,
    Activate: DeviceWorker._on_activate,
    Evict: DeviceWorker._on_evict,
    PlanEvict: lambda w, cmd: w.plan_evict(cmd.model),
    Prefetch: lambda w, cmd: w.prefetch(cmd.model),
    Publish: lambda w, cmd: w._publish(),
    CheckIntegrity: DeviceWorker._on_check,
    Call: lambda w, cmd: cmd.fn(),
}
