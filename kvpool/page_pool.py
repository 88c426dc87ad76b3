"""The page pool of one device: physical pages shared by every model on it.

All pages have the same size, so a page one model gives back is usable by any other at once. The
pool creates handles ahead of need up to its budget and keeps them (creating is the expensive driver
call); it never releases them to the driver while it lives. Accounting is exact: every created page
is either free in the pool or owned by exactly one owner. Thread-safe (one re-entrant lock).

When an owner asks for more pages than are free and the budget allows no more, the pool asks other
owners to give back pages they hold but do not use (their cached reserve), through the `Reclaimer`
they registered, in the order a `ReclaimOrder` given from outside decides (the balloon policy, in
scheduler/); without one, no owner's pages are taken for another.

Free pages may be held for one model (`hold_for`): pages another thread freed for it, which no
other owner takes while the hold lasts (its owners are the model's name and "name/...").
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.backend import MemoryBackend, PhysicalHandle


class Reclaimer(Protocol):
    def reclaimable_pages(self) -> int:
        """Pages held but not in use, that reclaim_pages could give back now."""

    def reclaim_pages(self, n: int) -> int:
        """Give back up to n unused pages (through PagePool.release); return how many."""


@dataclass(frozen=True)
class OwnerUsage:
    """What the reclaim order sees of one owner."""

    name: str
    pages: int
    reclaimable: int  # pages it could give back now
    last_grow: int  # sequence number of its last grant (0 = never)


# (other owners with a reclaimer, the owner asking) -> names to reclaim from, first to last
ReclaimOrder = Callable[[Sequence[OwnerUsage], str], list[str]]


@dataclass(frozen=True)
class PageMove:
    """Pages that went from one owner to another (or back to the pool: taker None), and why."""

    seq: int
    time: float  # time.monotonic()
    giver: str
    taker: str | None
    pages: int
    reason: str  # "reserve" (cached KV taken for another's grant), "evict", "keep-alive", ...


@dataclass
class _Owner:
    name: str
    reclaim: Reclaimer | None
    kind: str = "kv"  # what its pages hold: "kv" or "weights"
    pages: int = 0
    last_grow: int = 0


@dataclass(frozen=True)
class PoolStats:
    page_bytes: int
    capacity: int  # pages the budget allows, null page excluded
    created: int
    free: int
    owned: dict[str, int]
    owned_by_kind: dict[str, int]  # "kv" / "weights" -> pages
    moved: dict[tuple[str, str, str], int]  # (giver, taker or "", reason) -> pages, in all


class PagePool:
    def __init__(
        self,
        backend: MemoryBackend,
        page_bytes: int,
        budget_bytes: int,
        precreate: int = 0,
        reclaim_order: ReclaimOrder | None = None,
    ):
        self.backend = backend
        self.reclaim_order = reclaim_order
        self.page_bytes = backend.round_up(page_bytes)
        # One page of the budget backs the shared null page (page 0 of every model).
        self.capacity = budget_bytes // self.page_bytes - 1
        if self.capacity < 1:
            raise ValueError(
                f"budget of {budget_bytes} bytes holds fewer than 2 pages "
                f"of {self.page_bytes} bytes"
            )
        self.null_handle = backend.create(self.page_bytes)
        self._free: list[PhysicalHandle] = []
        self._created = 0
        self._owners: dict[str, _Owner] = {}
        self._clock = itertools.count(1)
        # churn counters (pages, since creation)
        self.acquired_total = 0
        self.released_total = 0
        self.reclaimed_total = 0  # pages taken back from one owner's reserve for another
        self.moves: deque[PageMove] = deque(maxlen=256)  # the latest page moves
        self._moved: dict[tuple[str, str, str], int] = {}
        self._move_seq = itertools.count(1)
        self._held: tuple[str, int] | None = None  # (model, free pages no one else may take)
        self._lock = threading.RLock()
        self.precreate(precreate)

    # ---- owners -------------------------------------------------------------------------------
    def register(self, owner: str, reclaim: Reclaimer | None = None, kind: str = "kv") -> None:
        with self._lock:
            if owner in self._owners:
                raise ValueError(f"owner {owner!r} is already registered")
            self._owners[owner] = _Owner(owner, reclaim, kind)

    def set_reclaimer(self, owner: str, reclaim: Reclaimer | None) -> None:
        with self._lock:
            self._owners[owner].reclaim = reclaim

    def unregister(self, owner: str) -> None:
        with self._lock:
            o = self._owners.pop(owner)
            if o.pages:
                self._owners[owner] = o
                raise RuntimeError(f"owner {owner!r} still holds {o.pages} pages")

    def pages_of(self, owner: str) -> int:
        return self._owners[owner].pages

    # ---- pages --------------------------------------------------------------------------------
    def precreate(self, n: int) -> None:
        """Create up to n more handles now, off the critical path."""
        with self._lock:
            for _ in range(min(n, self.capacity - self._created)):
                self._free.append(self.backend.create(self.page_bytes))
                self._created += 1

    @property
    def num_available(self) -> int:
        """Pages obtainable without reclaiming: free handles plus those the budget still allows
        (held ones included)."""
        return len(self._free) + self.capacity - self._created

    def _holds_for(self, owner: str) -> bool:
        """Whether the hold is for owner's model."""
        return self._held is not None and owner.split("/")[0] == self._held[0]

    def available_to(self, owner: str) -> int:
        """num_available less the pages held for another model."""
        with self._lock:
            if self._held is None or self._holds_for(owner):
                return self.num_available
            return max(self.num_available - self._held[1], 0)

    def hold_for(self, model: str, n: int) -> None:
        """Keep n more free pages for `model` (its owners take them first, no one else may),
        until it has taken them or `release_hold`. A hold for another model is replaced."""
        with self._lock:
            kept = self._held[1] if self._held is not None and self._held[0] == model else 0
            self._held = (model, kept + n)

    def release_hold(self, keep: str | None = None) -> None:
        """End the hold, unless it is for `keep`."""
        with self._lock:
            if self._held is not None and self._held[0] != keep:
                self._held = None

    @property
    def held(self) -> tuple[str, int] | None:
        return self._held

    def _usage(self, exclude: str) -> list[OwnerUsage]:
        return [
            OwnerUsage(o.name, o.pages, o.reclaim.reclaimable_pages(), o.last_grow)
            for o in self._owners.values()
            if o.name != exclude and o.reclaim is not None
        ]

    def reclaimable(self, exclude: str) -> int:
        """Pages other owners could give back to `exclude` (not counting those they use)."""
        if self.reclaim_order is None:
            return 0
        return sum(u.reclaimable for u in self._usage(exclude))

    def can_acquire(self, owner: str, n: int, reclaim: bool = True) -> bool:
        with self._lock:
            free = self.available_to(owner)
            if n <= free:
                return True
            return reclaim and n <= free + self.reclaimable(exclude=owner)

    def free_up(self, n: int, taker: str) -> int:
        """Take other owners' reserves back (the reclaim order) until n pages are free, for
        `taker`, whose buffer maps free pages only (it is mapped from another thread); returns
        the pages free then. Call it from the thread that owns the other owners."""
        with self._lock:
            short = n - self.available_to(taker)
            if short > 0 and self.reclaim_order is not None:
                short = min(short, self.reclaimable(exclude=taker))
                if short > 0:
                    self._reclaim_from_others(taker, short)
            return self.available_to(taker)

    def acquire(self, owner: str, n: int, reclaim: bool = True) -> list[PhysicalHandle] | None:
        """n pages for `owner`, or None (and nothing taken) if they cannot be had. reclaim
        False: free pages only, no other owner's reserve (the caller is not the thread that
        owns the other owners' allocators)."""
        with self._lock:
            o = self._owners[owner]
            short = n - self.available_to(owner)
            if short > 0:
                if not reclaim or short > self.reclaimable(exclude=owner):
                    return None  # reclaiming could not cover it: take nobody's pages for nothing
                self._reclaim_from_others(owner, short)
                if n > self.available_to(owner):
                    return None
            self.precreate(n - len(self._free))
            handles = [self._free.pop() for _ in range(n)]
            if self._holds_for(owner):
                left = self._held[1] - n
                self._held = (self._held[0], left) if left > 0 else None
            o.pages += n
            o.last_grow = next(self._clock)
            self.acquired_total += n
            return handles

    def release(self, owner: str, handles: list[PhysicalHandle]) -> None:
        with self._lock:
            o = self._owners[owner]
            if len(handles) > o.pages:
                raise RuntimeError(f"{owner!r} releases {len(handles)} pages but owns {o.pages}")
            o.pages -= len(handles)
            self._free.extend(handles)
            self.released_total += len(handles)

    def _reclaim_from_others(self, owner: str, short: int) -> None:
        if self.reclaim_order is None:
            return
        for name in self.reclaim_order(self._usage(owner), owner):
            if short <= 0:
                break
            o = self._owners[name]
            if name == owner or o.reclaim is None:
                raise RuntimeError(f"the reclaim order named {name!r}, which cannot give pages")
            got = o.reclaim.reclaim_pages(short)
            self.reclaimed_total += got
            short -= got
            if got:
                self.record_move(name, owner, got, "reserve")

    def record_move(self, giver: str, taker: str | None, pages: int, reason: str) -> None:
        """Log a page move (the pool logs reclaims itself; evictions are logged by whoever
        decided them, with their reason)."""
        with self._lock:
            self.moves.append(
                PageMove(next(self._move_seq), time.monotonic(), giver, taker, pages, reason)
            )
            key = (giver, taker or "", reason)
            self._moved[key] = self._moved.get(key, 0) + pages

    # ---- checks -------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._lock:
            by_kind: dict[str, int] = {}
            for o in self._owners.values():
                by_kind[o.kind] = by_kind.get(o.kind, 0) + o.pages
            return PoolStats(
                self.page_bytes,
                self.capacity,
                self._created,
                len(self._free),
                {o.name: o.pages for o in self._owners.values()},
                by_kind,
                dict(self._moved),
            )

    def check_integrity(self) -> None:
        with self._lock:
            owned = sum(o.pages for o in self._owners.values())
            assert owned + len(self._free) == self._created, (owned, len(self._free), self._created)
            assert self._created <= self.capacity, (self._created, self.capacity)
            assert len({id(h) for h in self._free}) == len(self._free), "handle freed twice"

    def close(self) -> None:
        with self._lock:
            if any(o.pages for o in self._owners.values()):
                raise RuntimeError("closing a pool whose pages are still owned")
            for h in self._free:
                self.backend.release(h)
            self.backend.release(self.null_handle)
            self._created -= len(self._free)
            self._free.clear()
