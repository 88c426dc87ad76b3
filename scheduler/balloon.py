"""The balloon: which models give pages when another needs them. Pure: plain data in, names and
counts out; the device worker builds the data from its models and carries the decisions out.

Past the free pages, a model that needs pages gets, in turn:
1. other owners' reserves (cached, unused pages), in the reclaim order: idle models first, then
   least recently grown first, so the model that burst last keeps its reserve (the pool
   executes the order; kvpool holds no policy);
2. the weights and KV of idle models, evicted least recently used first;
3. for new work only, one running request of another model, preempted: the one with the least
   to recompute whose KV covers what the new work needs, else the one that frees the most (so
   one preemption, not a cascade of small ones, makes the room); a request goes once at most,
   and new work whose TTFT deadline has passed preempts nothing (it would miss anyway: it waits
   for pages that running requests give back as they end).
Models whose new work waits for memory are starved; one of them, the taker, takes from the
others at a time (two taking from each other would thrash), and while one waits the others
admit nothing new. A model whose need is beyond reach (more than the pool could give with every
other model's KV and every idle model's weights back) is not starved: it waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.snapshot import Residency

_NEVER = float("inf")


class ReclaimCandidate(Protocol):
    name: str
    reclaimable: int  # pages it could give back now
    last_grow: int  # pool sequence number of its last grant (0 = never)


@dataclass(frozen=True)
class ModelState:
    """One model of a device as the balloon sees it (times in the engine's monotonic seconds,
    sizes in pages of the device's pool)."""

    name: str
    residency: Residency
    evictable: bool = True  # it may be evicted (not pinned; its weights have a host copy)
    last_used: float = 0.0  # when it last stepped or was given a request
    requests: int = 0  # its requests, waiting or running
    running: int = 0  # its requests running
    has_work: bool = False  # a request waits or runs
    has_new_work: bool = False  # a request that never ran waits (not a preempted one's recompute)
    kv_pages: int = 0  # pages its KV maps
    weight_pages: int = 0  # pages its weights hold on the device (or need there, offloaded)
    first_arrival: float = _NEVER  # its first new request's arrival (else any request's)
    first_deadline: float = _NEVER  # that new request's TTFT deadline
    oldest_arrival: float = _NEVER  # the arrival of its request that has waited longest
    shard_devices: tuple[str, ...] = ()  # the other devices it is split over

    @property
    def on_device(self) -> bool:
        return self.residency.on_device

    @property
    def idle(self) -> bool:
        return self.requests == 0


@dataclass(frozen=True)
class RunningRequest:
    """A running request another model's new work could preempt."""

    model: str
    request_id: str
    computed_tokens: int  # what a preemption throws away and the request recomputes
    arrival_time: float
    preemptions: int = 0
    finished: bool = False  # it ended in a step not read yet
    pages: float = 0.0  # the pool pages its KV blocks fill (what preempting it gives back)


@dataclass(frozen=True)
class LastResort:
    """What a model that waits for pages the pool has not got may take, in this order."""

    keep: frozenset[str]  # models never evicted for it (itself, the taker)
    stalled: bool  # a model whose requests all wait for memory may be evicted for it
    new_work: bool  # it waits for new work: a running request of another model may go for it


def reclaim_order(
    candidates: Sequence[ReclaimCandidate], requester: str, busy: frozenset[str] = frozenset()
) -> list[str]:
    """Owners to reclaim from, first to last; the requester and owners with nothing to give are
    left out. busy: owners whose models have requests (they give after the idle ones)."""
    ranked = sorted(
        (c for c in candidates if c.name != requester and c.reclaimable > 0),
        key=lambda c: (c.name in busy, c.last_grow, c.name),
    )
    return [c.name for c in ranked]


def eviction_order(
    models: Sequence[ModelState], keep: frozenset[str] = frozenset(), stalled: bool = False
) -> list[str]:
    """The models that may be evicted for room, least recently used first: resident, evictable,
    not in `keep`, and without requests (stalled: without running requests; one whose requests
    all wait for memory may go, they wait for its next activation)."""
    idle = [
        m
        for m in models
        if m.residency is Residency.RESIDENT
        and m.evictable
        and m.name not in keep
        and not (m.running if stalled else m.requests)
    ]
    return [m.name for m in sorted(idle, key=lambda m: m.last_used)]


def expired(
    deadlines: Sequence[tuple[str, float | None]], now: float
) -> tuple[list[str], float | None]:
    """Models idle past their keep-alive, of (name, deadline; None: never) pairs, and the next
    deadline of the others (None: none)."""
    due, nxt = [], None
    for name, until in deadlines:
        if until is None:
            continue
        if until <= now:
            due.append(name)
        else:
            nxt = until if nxt is None else min(nxt, until)
    return due, nxt


def next_taker(held: ModelState | None, starved: Sequence[ModelState]) -> str | None:
    """The starved model that takes memory first. The current taker (held) keeps its turn while
    it has work and nothing of it runs (it activates, or the arbitrator has not stepped it since),
    or while it is starved; else a resident one (its activation is paid) before an offloaded
    one, then the one whose new request came first."""
    starving = frozenset(m.name for m in starved)
    if held is not None and held.has_work and (held.name in starving or not held.running):
        return held.name
    if not starved:
        return None
    return min(starved, key=lambda m: (not m.on_device, m.first_arrival, m.name)).name


def admitting(starved: frozenset[str], taker: str | None) -> frozenset[str]:
    """The models that may admit new requests this step (empty: every model): while some wait for
    memory for new work, those (the taker alone, when one takes), so the pages freed go to them."""
    return starved if taker is None else frozenset({taker})


def may_activate(model: str, taker: str | None) -> bool:
    """Whether an offloaded model with work may start its activation now: not while another
    starved model takes memory first."""
    return taker is None or taker == model


def pages_needed(blocks: int, free_blocks: int, blocks_per_page: int, weight_pages: int) -> int:
    """Pages a model needs for its next `blocks` KV blocks with `free_blocks` of its own free,
    plus its weights' pages (0 if resident)."""
    return -(-max(blocks - free_blocks, 0) // blocks_per_page) + weight_pages


def within_reach(
    need: int, model: str, available: int, models: Sequence[ModelState], foreign_kv: int = 0
) -> bool:
    """Whether `need` pages for `model` are at most what the pool could give it (`available` free
    to it now) if every other resident model's KV pages and every idle model's weights came
    back; foreign_kv: KV pages of other devices' models split over this one (they preempt)."""
    reach = available + foreign_kv
    for o in models:
        if o.name == model or not o.on_device:
            continue
        reach += o.kv_pages
        if o.idle and o.evictable:
            reach += o.weight_pages
    return need <= reach


def last_resort(
    m: ModelState, starved: frozenset[str], taker: str | None, now: float = 0.0
) -> LastResort | None:
    """What m, short of pages, may take; None: nothing now (m is starved and another model takes:
    m's turn comes when the taker's new work runs). A stalled model goes for the taker, or for
    another model when no one takes (two stalled models must not wait for each other forever);
    not for a running request's growth (the evicted model would take the memory straight back
    as the next taker). Running requests go only for new work that can still meet its TTFT
    deadline at `now`."""
    if m.name in starved and m.name != taker:
        return None
    return LastResort(
        keep=frozenset({m.name, taker} - {None}),
        stalled=m.name == taker or (taker is None and not m.running),
        new_work=m.name in starved and m.has_new_work and now < m.first_deadline,
    )


def preemptible(requests: Sequence[RunningRequest]) -> list[RunningRequest]:
    """The requests that may be preempted: never preempted before (a request goes once at most:
    takers in turn preempting each other's requests would finish none) and not finished."""
    return [r for r in requests if r.preemptions == 0 and not r.finished]


def preempt_victim(
    requests: Sequence[RunningRequest], need_pages: float = 0
) -> RunningRequest | None:
    """The request to preempt for another model's new work that needs `need_pages` pages: of the
    preemptible ones whose KV covers the need alone, the one with the fewest computed tokens (the
    least to recompute), then the latest to arrive; when none covers it, the one that gives the
    most pages back (the fewest preemptions make the room: small victims one after another would
    each stall and recompute while the newcomer still waits)."""
    victims = preemptible(requests)
    if not victims:
        return None
    covering = [r for r in victims if r.pages >= need_pages]
    if covering:
        return min(covering, key=lambda r: (r.computed_tokens, -r.arrival_time, r.request_id))
    return max(victims, key=lambda r: (r.pages, -r.computed_tokens, r.arrival_time, r.request_id))


def shards_to_release(
    models: Sequence[ModelState], device: str, starved: frozenset[str]
) -> tuple[list[str], list[str]]:
    """For `device`, short of pages that this device's models split over it hold there: those to
    evict (resident, evictable and idle), and those whose running requests may be preempted
    instead when none is idle (resident and not starved themselves)."""
    split = [m for m in models if device in m.shard_devices and m.residency is Residency.RESIDENT]
    idle = [m.name for m in split if m.evictable and m.idle]
    busy = [m.name for m in split if m.name not in starved]
    return idle, busy


def swap_turn(cap: int, models: Sequence[ModelState]) -> frozenset[str]:
    """Under a cap of `cap` models on the device: the offloaded models that may activate now, the
    one whose request has waited longest once a place is free (else none)."""
    on = sum(m.on_device for m in models)
    waiting = [m for m in models if m.residency is Residency.OFFLOADED and m.has_work]
    if on >= cap or not waiting:
        return frozenset()
    return frozenset({min(waiting, key=lambda m: m.oldest_arrival).name})
