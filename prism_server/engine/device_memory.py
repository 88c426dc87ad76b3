"""Carries out the balloon's decisions (scheduler/balloon.py, through the device's policy) on one
device's models, on its engine thread: evictions, preemptions, activations that make room, and
asks to the other devices for the pages a model split over them needs there. It decides
nothing itself: it builds the balloon's plain data from the models and does what comes back."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from prism_server.engine.commands import MakeFree, ReleaseShards
from prism_server.engine.model_worker import ModelWorker
from scheduler import balloon
from scheduler.balloon import ModelState, RunningRequest
from scheduler.snapshot import Residency

if TYPE_CHECKING:
    from prism_server.engine.device_worker import DeviceWorker

log = logging.getLogger(__name__)


def holding(m: ModelWorker) -> ModelState:
    """m as eviction and reach read it: what it holds and whether it is busy (cheap: no scan of
    its requests; their arrivals and new work are left out)."""
    return ModelState(
        name=m.name,
        residency=m.residency,
        evictable=m.evictable,
        last_used=m.last_used,
        requests=len(m.requests),
        running=len(m.scheduler.running),
        kv_pages=m.kv.allocator.num_mapped_pages,
        # its adapters' pages go with its own when it is evicted
        weight_pages=(m.weights.num_pages if m.weights is not None else 0) + m.adapter_pages,
        shard_devices=tuple(m.shard_devices),
    )


def model_state(m: ModelWorker) -> ModelState:
    """m as the balloon sees it, whole."""
    every = [r.arrival_time for r in m.requests.values()]
    new = [r for r in m.scheduler.waiting if r.first_scheduled_time is None]
    first = min(new, key=lambda r: r.arrival_time, default=None)
    return dataclasses.replace(
        holding(m),
        has_work=m.has_work,
        has_new_work=m.scheduler.has_new_work,
        first_arrival=first.arrival_time if first else min(every, default=float("inf")),
        first_deadline=first.ttft_deadline if first else float("inf"),
        oldest_arrival=min(every, default=float("inf")),
    )


def preempt_one(
    models: list[ModelWorker], why: str, need_pages: int = 0
) -> tuple[ModelWorker, int] | None:
    """Preempt the running request of `models` the balloon picks for another model's new work
    that needs `need_pages` pages. Returns its model and the pages its KV unmapped (None: no
    request may go)."""

    def running() -> list[RunningRequest]:
        return [
            RunningRequest(
                o.name,
                r.request_id,
                r.num_computed_tokens,
                r.arrival_time,
                r.num_preemptions,
                r.finish_reason is not None or r.is_finished,
                len(r.block_table) / o.kv.allocator.bpp,
            )
            for o in models
            for r in o.scheduler.running
        ]

    by_name = {o.name: o for o in models}
    for name in dict.fromkeys(r.model for r in running() if r.preemptions == 0):
        by_name[name].sync()  # its step launched ahead may still write the victim's blocks
    victim = balloon.preempt_victim(running(), need_pages)
    if victim is None:
        return None
    owner = by_name[victim.model]
    req = next(r for r in owner.scheduler.running if r.request_id == victim.request_id)
    before = owner.kv.allocator.num_mapped_pages
    owner.scheduler.preempt(req)
    log.info("preempted %s of %s for %s", req.request_id, owner.name, why)
    return owner, before - owner.kv.allocator.num_mapped_pages


class DeviceMemory:
    """The balloon's actuator of one device (engine thread only)."""

    def __init__(self, worker: DeviceWorker):
        self.worker = worker
        self.pool = worker.pool
        self.policy = worker.policy
        self.models = worker.models  # the worker's dict, shared
        self.starved: frozenset[str] = frozenset()  # models whose new work waits for memory
        # the one starved model that may take memory from others (evict, preempt, activate)
        # until its new work runs: two starved models taking from each other would thrash
        self.taker: str | None = None
        self._asked: dict[str, Future] = {}  # the last ask for room sent to each peer
        self.pool.reclaim_order = self._reclaim_order if self.policy.reclaims() else None

    def states(self) -> list[ModelState]:
        return [model_state(m) for m in self.models.values()]

    def _reclaim_order(self, usage, requester: str) -> list[str]:
        busy = frozenset(m.name for m in self.models.values() if m.requests)
        return self.policy.reclaim_order(usage, requester, busy)

    def evict(
        self, m: ModelWorker, reason: str, taker: str | None = None, drain_s: float = 0.0
    ) -> None:
        """Evict m and log the pages it gives up (all it holds) as one move, with the reason."""
        on = m.residency.on_device
        pages = m.kv.allocator.num_mapped_pages + (m.weights.num_pages if on else 0)
        pages += m.adapter_pages
        m.evict(drain_s)
        m.evicted_for = reason
        if on:
            self.pool.record_move(m.name, taker, pages, reason)

    def make_room(
        self,
        fits,
        now: float,
        keep: frozenset[str] = frozenset(),
        taker: str | None = None,
        limit: int | None = None,
        stalled: bool = False,
    ) -> list[str]:
        """Evict idle models in the balloon's order until `fits()` (at most `limit`); returns
        the evicted names (fits() may still be false when nothing else could go). Idle LoRA
        adapters go first (a few pages each, back in a few MB of copy), unless a limit is set
        (a last resort: evict_idle_adapter)."""
        evicted: list[str] = []
        while limit is None and not fits() and self.evict_idle_adapter(taker):
            pass
        held = [holding(m) for m in self.models.values()]
        for name in balloon.eviction_order(held, keep, stalled):
            if fits() or (limit is not None and len(evicted) >= limit):
                break
            self.evict(self.models[name], "evict", taker)
            evicted.append(name)
            log.info("evicted %s for room", name)
        return evicted

    def evict_idle_adapter(self, taker: str | None) -> bool:
        """Evict the least recently used resident adapter (of any model) that no request
        needs, its pages to `taker`; False if there is none."""
        idle = [
            (a, m)
            for m in self.models.values()
            if m.adapters
            for a in m.adapters.idle(m.busy_adapters())
        ]
        if not idle:
            return False
        a, m = min(idle, key=lambda am: am[0].last_used)
        self._evict_adapter(m, a.name, taker, "room")
        return True

    def evict_parked_adapter(self, m: ModelWorker) -> bool:
        """m blocked on memory with nothing running: evict its least recently used resident
        adapter but for the first request's in line (else adapters activated for requests
        that wait could hold the pages that request's KV needs, nothing running to free
        any); False if there is none (or something of m runs)."""
        parked = m.parked_adapters()
        if not parked:
            return False
        self._evict_adapter(m, parked[0].name, m.name, "its blocked work")
        return True

    def _evict_adapter(self, m: ModelWorker, name: str, taker: str | None, why: str) -> None:
        """Evict m's adapter `name`, its pages to `taker` (recorded as a move)."""
        pages = m.evict_adapter(name)
        self.pool.record_move(name, taker, pages, "evict")
        log.info("evicted adapter %s of %s for %s", name, m.name, why)

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

    def expire(self, now: float) -> float | None:
        """Evict models idle past their keep-alive; returns the next such deadline."""
        keep_alive = self.policy.keep_alive_s
        deadlines = [(m.name, m.idle_until(keep_alive)) for m in self.models.values()]
        due, nxt = balloon.expired(deadlines, now)
        for name in due:
            try:
                self.evict(self.models[name], "keep-alive")
                log.info("evicted %s: idle past its keep-alive", name)
            except Exception:
                log.exception("keep-alive eviction of %s failed", name)
        return nxt

    # ---- after each step: who is starved, who takes, the last resorts ---------------------------
    def relieve(
        self,
        serving: list[ModelWorker],
        starved: list[ModelWorker],
        now: float,
    ) -> None:
        """Models blocked on memory after a step: the starved ones the balloon can help (their
        pages exist once others' KV is freed), the taker, then each one's last resort."""
        blocked = [m for m in serving if m.scheduler.blocked]
        starved += [m for m in blocked if m.scheduler.has_new_work]
        starved = [m for m in starved if self._within_reach(m)]
        self.starved = frozenset(m.name for m in starved)
        held = self.models.get(self.taker) if self.taker is not None else None
        self.taker = self.policy.next_taker(
            model_state(held) if held is not None else None, [model_state(m) for m in starved]
        )
        self.pool.release_hold(keep=self.taker)  # pages held for a taker that took them or left
        for m in dict.fromkeys(starved + blocked):
            self._last_resort(m, serving, starved, now)

    @staticmethod
    def _pages_needed(m: ModelWorker) -> int:
        """The pages m needs for its first waiting request (a new one, else a preempted one's
        recompute): its KV beyond m's free blocks, and its weights if offloaded."""
        a = m.kv.allocator
        waiting = m.scheduler.waiting
        first = next((r for r in waiting if r.first_scheduled_time is None), None)
        if first is None and waiting:  # a preempted request's recompute
            first = waiting[0]
        blocks = m.scheduler.blocks_to_start(first) if first is not None else 1
        offloaded = m.residency is Residency.OFFLOADED
        return balloon.pages_needed(
            blocks, a.num_free_blocks, a.bpp, m.weights.num_pages if offloaded else 0
        )

    def _within_reach(self, m: ModelWorker) -> bool:
        need = self._pages_needed(m)
        foreign = 0
        if self.worker.peers:  # the KV of other devices' models split over this one
            owned = self.pool.stats().owned
            foreign = sum(n for o, n in owned.items() if "/" not in o and o not in self.models)
        others = [holding(o) for o in self.models.values() if o is not m and o.residency.on_device]
        return balloon.within_reach(need, m.name, self.pool.available_to(m.name), others, foreign)

    def _last_resort(
        self, m: ModelWorker, serving: list[ModelWorker], starved: list[ModelWorker], now: float
    ) -> None:
        """m waits for pages the pool has not got (free pages and other models' reserves are
        gone): one move per step, as the balloon says."""
        state = model_state(m)
        resort = self.policy.last_resort(state, self.starved, self.taker, now)
        if resort is None:
            return
        needed = self._pages_needed(m)  # (unchanged below: each move returns at once)
        wanted = max(needed, 1)
        short = [  # a split model: its shards' devices whose pools have not the pages it needs
            d
            for d, c in zip(m.shard_devices, m.kv.caches[1:])
            if c.pages.pool.available_to(m.name) < wanted
        ]
        for device in short:
            self._ask_for_room(device, wanted, m.name, now)
        if short and self.pool.available_to(m.name) >= wanted:
            return  # the pages it waits for are on those devices, not here
        if self.evict_idle_adapter(m.name):  # the cheapest pages first: one move per step
            return
        if self.evict_parked_adapter(m):  # then its own adapters whose requests all wait
            return
        if self.make_room(lambda: False, now, resort.keep, m.name, 1, resort.stalled):
            if self.taker is None:  # the pages it freed are its own until it runs: the model
                self.taker = m.name  # evicted (stalled too) must not take them straight back
            return
        others = [o for o in serving if o is not m and o not in starved]
        need = max(needed - self.pool.available_to(m.name), 0)
        got = preempt_one(others if resort.new_work else [], f"{m.name}'s new work", need)
        if got is not None:
            owner, freed = got
            self.pool.record_move(owner.name, m.name, freed, "preempt")
        # the other devices evict their idle models split over this one; for new work with no
        # request here to preempt, a busy one of them gives up a request instead
        self._ask_for_shards(now, taker=m.name if resort.new_work and got is None else None)

    # ---- other devices --------------------------------------------------------------------------
    def _ask_for_room(self, device: str, pages: int, taker: str, now: float) -> None:
        """Ask another device to make `pages` pages of its pool free for `taker`, a model this
        device steps with a shard there (its shards map free pages only): that device's thread
        takes reserves back, then evicts idle models."""
        self._ask(device, MakeFree(pages, taker, now))

    def _ask(self, device: str, ask: MakeFree | ReleaseShards) -> None:
        """Send `ask` to another device. Not waited for; one ask in flight a device."""
        peer, asked = self.worker.peers.get(device), self._asked.get(device)
        if peer is None or (asked is not None and not asked.done()):
            return
        self._asked[device] = ask.done
        peer.send(ask)

    def _ask_for_shards(self, now: float, taker: str | None = None) -> None:
        """Short of pages with nothing of its own to evict: ask every other device to evict its
        idle models split over this one (their shards here hold pages this device's models
        cannot take otherwise); taker: a model of this device whose new work waits, for which
        a busy one gives up a request when none is idle."""
        stats = self.pool.stats()
        name = self.worker.name
        mine = set(self.models)
        mine |= {a for m in self.models.values() if m.adapters for a in m.adapters.by_name}
        if any(n and o.split("/")[0] not in mine for o, n in stats.owned.items()):
            for device in self.worker.peers:
                self._ask(device, ReleaseShards(name, now, taker))

    def release_shards(self, device: str, now: float, taker: str | None = None) -> list[str]:
        """Evict this device's idle models split over `device` (asked by it: short of pages).
        None idle and a taker named: preempt one running request of a busy one, its model's
        unused pages given back, and the pages that frees on `device` held there for the
        taker."""
        held = [holding(m) for m in self.models.values()]
        idle, busy = balloon.shards_to_release(held, device, self.starved)
        for name in idle:
            self.evict(self.models[name], "evict", f"{device} models")
            log.info("evicted %s: %s needs the pages its shard holds there", name, device)
        if idle or taker is None:
            return idle
        ms = [self.models[n] for n in busy]
        pools = {m.name: m.kv.caches[1 + m.shard_devices.index(device)].pages.pool for m in ms}
        before = {n: p.pages_of(n) for n, p in pools.items()}  # its reserve goes back too
        got = preempt_one(ms, f"{taker} on {device}")
        if got is not None:
            owner = got[0]
            a = owner.kv.allocator
            a.reclaim_pages(a.reclaimable_pages())  # unmapped in every shard's pool
            pool = pools[owner.name]
            freed = before[owner.name] - pool.pages_of(owner.name)
            pool.hold_for(taker, freed)
            pool.record_move(owner.name, taker, freed, "preempt")
        return idle

    def make_free(self, pages: int, taker: str, now: float) -> None:
        """`pages` pages of this device's pool free for a shard of `taker`, a model another
        device steps (asked by it): other models' reserves first, then idle models, least
        recently used first."""
        if self.pool.free_up(pages, taker) < pages:
            self.make_room(lambda: self.pool.available_to(taker) >= pages, now, taker=taker)
