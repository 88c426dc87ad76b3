"""The LoRA adapters of one base model on its device, driven by the engine thread only.

Each adapter's weights are a pool owner of their own (`<adapter>/weights`, a WeightBuffer) with a
host copy, as a model's are; its requests are its base's requests tagged with its name, and the
base's steps run them. Before a step, every adapter with work is made ready (`prepare`): its pages
mapped and its host copy loaded (activation), and a slot of the base's LoraSlots given to it
(a slot held by an adapter with no running request may be taken). An activation's copy runs on
the copy stream (a thread off a GPU) while the engine thread goes on: its adapter is ready at
the first `prepare` after the copy landed, its requests waiting until then (the base's other
work runs meanwhile). An idle adapter may be evicted
(its pages back to the pool); an offloaded base has every adapter evicted. Views of an adapter's
buffer keep their addresses while it is evicted: its slot needs no re-assignment after an
activation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpool import HostBudget, HostCopy, Transfer, WeightBuffer, WeightLayout, map_and_load
from models.lora import DEFAULT_MAX_RANK, NO_ADAPTER, LoraAdapter, LoraSlots, LoraWeights
from scheduler.request import RequestStatus
from scheduler.snapshot import AdapterSnapshot

if TYPE_CHECKING:
    from concurrent.futures import Future

    from kvpool import PagePool
    from scheduler.batch_scheduler import ScheduledChunk
    from scheduler.request import Request

log = logging.getLogger(__name__)

# make_room(fits) -> the names evicted: idle models (and adapters) evicted until fits()
MakeRoom = Callable[[Callable[[], bool]], list[str]]


@dataclass(eq=False)
class ServedAdapter:
    """One adapter of the base: its buffer, host copy and slot."""

    name: str
    path: str
    rank: int
    weights: LoraWeights  # views into `buffer`
    buffer: WeightBuffer
    host: HostCopy
    slot: int | None = None
    loading: Transfer | None = None  # its activation's copy, in flight
    last_used: float = 0.0
    requests_total: int = 0
    activations: int = 0
    evictions: int = 0
    # an unload waiting for its requests to finish (resolved once it is gone)
    unloading: list[Future] = field(default_factory=list)
    budget: HostBudget | None = None  # what its host copy took its bytes from

    @property
    def resident(self) -> bool:
        return self.buffer.mapped


class BaseAdapters:
    """The adapters of one base model (its LoraSlots with `num_slots` slots, of adapters of
    rank at most `max_rank`)."""

    def __init__(
        self,
        base: torch.nn.Module,
        num_slots: int,
        make_room: MakeRoom | None = None,
        max_rank: int = DEFAULT_MAX_RANK,
    ):
        self.slots = LoraSlots(base, num_slots, max_rank)
        self.by_name: dict[str, ServedAdapter] = {}
        self.make_room = make_room  # for an activation the pool has not the free pages of
        # the last prepare left an adapter waiting for pages (its base is then blocked on memory,
        # so that the balloon frees some)
        self.short_of_pages = False

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    # ---- registering ----------------------------------------------------------------------------
    def add(
        self,
        adapter: LoraAdapter,
        pool: PagePool,
        device: torch.device,
        on_device: bool,
        host: HostBudget | None = None,
    ):
        """Place `adapter` in `pool` (owner `<name>/weights`): its host copy written from its
        tensors (its bytes taken from `host`), then its pages mapped and loaded now if its base
        is on the device (`on_device`) and the pool gives them (after make_room); else it waits
        offloaded, as after an eviction, and its first request activates it. MemoryError if
        the pool could never hold it, or the host budget cannot now."""
        name = adapter.name
        if name in self.by_name:
            raise ValueError(f"adapter {name!r} is already loaded")
        wb = WeightBuffer(pool, f"{name}/weights", WeightLayout.pack(adapter.weights.layout()))
        copy, taken = None, False
        try:
            if wb.num_pages > pool.capacity:
                raise MemoryError(
                    f"adapter {name} takes {wb.num_pages} pages of {wb.nbytes} bytes: more than "
                    f"the page pool's {pool.capacity}; raise pool_budget_bytes"
                )
            if host is not None:
                host.take(wb.nbytes, f"adapter {name}")
                taken = True
            copy = HostCopy(wb.nbytes, device)
            copy.data.zero_()  # (the alignment gaps too: its pages' bytes all known)
            staged = wb.layout.views(copy.data)
            for n, t in adapter.weights.named_tensors():
                staged[n].copy_(t)
            views = adapter.weights.over(wb.views())
            a = ServedAdapter(name, str(adapter.path), adapter.rank, views, wb, copy, budget=host)
            if on_device:
                if not wb.can_map() and self.make_room is not None:
                    self.make_room(wb.can_map)
                loading = map_and_load(wb, copy)
                if loading is not None:
                    try:
                        loading.wait()
                    except BaseException:
                        wb.unmap()
                        raise
        except BaseException:
            wb.close()
            if copy is not None:
                copy.close()
            if taken:
                host.give(wb.nbytes)
            raise
        a.last_used = time.monotonic()
        self.by_name[name] = a
        log.info("adapter %s (rank %d, %d bytes) loaded%s", name, adapter.rank, wb.nbytes,
                 "" if a.resident else ", offloaded until its first request")  # fmt: skip
        return a

    def remove(self, name: str) -> None:
        """Drop an adapter with no request left: its slot, pages and host copy."""
        a = self.by_name.pop(name)
        self._landed(a)  # (a copy in flight writes into its pages)
        if a.slot is not None:
            self.slots.clear(a.slot)
        a.buffer.close()
        a.host.close()
        if a.budget is not None:
            a.budget.give(a.buffer.nbytes)
        for done in a.unloading:
            if not done.done():
                done.set_result(None)
        log.info("adapter %s unloaded", name)

    # ---- residency ------------------------------------------------------------------------------
    def evict(self, name: str) -> int:
        """Give an adapter's pages back (the host copy is the truth; its slot stays: its views
        keep their addresses); -> the pages freed."""
        a = self.by_name[name]
        if not a.resident:
            return 0
        self._landed(a)  # a copy in flight lands before its pages go
        pages = a.buffer.num_pages
        a.buffer.unmap()
        a.evictions += 1
        return pages

    def evict_all(self) -> int:
        return sum(self.evict(n) for n in list(self.by_name))

    def idle(self, busy: set[str]) -> list[ServedAdapter]:
        """The resident adapters with no request (`busy`: those with some), least recently
        used first: the cheapest pages to give back."""
        out = [a for a in self.by_name.values() if a.resident and a.name not in busy]
        return sorted(out, key=lambda a: a.last_used)

    @property
    def loading(self) -> set[str]:
        """The adapters whose activation's copy is in flight."""
        return {a.name for a in self.by_name.values() if a.loading is not None}

    def _activate(self, a: ServedAdapter) -> bool | None:
        """Make `a` resident: True once its weights are on the device, None while its copy is
        in flight (started here or before), False when the pool has not its pages now."""
        if a.loading is None:
            if a.resident:
                return True
            if not a.buffer.can_map() and self.make_room is not None:
                self.make_room(a.buffer.can_map)
            a.loading = map_and_load(a.buffer, a.host)
            if a.loading is None:
                return False
        if not a.loading.done():
            return None
        self._landed(a)
        return True

    def _landed(self, a: ServedAdapter) -> None:
        """Wait for a's copy in flight, if any (at once when it is done; the device's stream
        ordered after it); a copy that failed leaves its pages unmapped and raises."""
        if a.loading is None:
            return
        transfer, a.loading = a.loading, None
        try:
            transfer.wait()
        except BaseException:
            a.buffer.unmap()
            raise
        a.activations += 1

    def prepare(
        self, wanted: Iterable[str], running: set[str], now: float, head: str | None = ""
    ) -> set[str]:
        """Make the adapters `wanted` (in order: the running requests' first) ready to run:
        resident and in a slot. A slot is taken from an adapter no running request has
        (`running`: those some has), one not wanted first. -> the ready ones (an adapter whose
        pages the pool cannot give now, or with no slot left, waits). head: while the base is
        blocked on memory with nothing running, the adapter of the first request in line
        (None: the base's own): then only it is made ready, so that the pages its KV needs go
        to it, not to adapters of requests behind it ("": not blocked)."""
        want = [n for n in dict.fromkeys(wanted) if n in self.by_name]
        if head != "":
            want = [n for n in want if n in running or n == head]
        ready: set[str] = set()
        self.short_of_pages = False
        for name in want:
            a = self.by_name[name]
            if a.slot is None and not self._give_slot(a, ready, running, want):
                continue
            done = self._activate(a)
            if done is False:
                self.short_of_pages = True
            if not done:  # short of pages, or its copy in flight
                continue
            a.last_used = now
            ready.add(name)
        return ready

    def _give_slot(self, a: ServedAdapter, ready: set[str], running: set[str], want) -> bool:
        slot = self.slots.free_slot()
        if slot is None:
            order = {n: i for i, n in enumerate(want)}
            holders = [
                h
                for h in self.by_name.values()
                if h.slot is not None and h.name not in ready and h.name not in running
            ]
            if not holders:
                return False
            # not wanted now first (least recently used), then the latest in line
            victim = min(holders, key=lambda h: (-order.get(h.name, len(want) + 1), h.last_used))
            slot, victim.slot = victim.slot, None
            self.slots.clear(slot)
        a.slot = slot
        self.slots.assign(slot, a.weights)
        return True

    # ---- a step ---------------------------------------------------------------------------------
    def token_slots(self, chunks: Sequence[ScheduledChunk]) -> list[int] | None:
        """Each of the step's tokens' adapter slot (NO_ADAPTER: the base's), chunk by chunk;
        None when no chunk has an adapter."""
        if not any(c.request.adapter is not None for c in chunks):
            return None
        token_slots: list[int] = []
        for c in chunks:
            name = c.request.adapter
            slot = NO_ADAPTER if name is None else self.by_name[name].slot
            if slot is None:
                raise RuntimeError(f"adapter {name} runs with no slot")
            token_slots += [slot] * c.num_new
        return token_slots

    # ---- state ----------------------------------------------------------------------------------
    def snapshot(self, base: str, requests: Iterable[Request]) -> tuple[AdapterSnapshot, ...]:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for r in requests:
            if r.adapter is not None:
                counts = running if r.status is RequestStatus.RUNNING else waiting
                counts[r.adapter] = counts.get(r.adapter, 0) + 1
        return tuple(
            AdapterSnapshot(
                name=a.name,
                base=base,
                path=a.path,
                rank=a.rank,
                resident=a.resident,
                activating=a.loading is not None,
                slot=a.slot,
                weight_bytes=a.buffer.nbytes,
                weight_pages=a.buffer.pages.num_mapped_pages,
                num_running=running.get(a.name, 0),
                num_waiting=waiting.get(a.name, 0),
                requests_total=a.requests_total,
                activations=a.activations,
                evictions=a.evictions,
                last_used=a.last_used,
            )
            for a in self.by_name.values()
        )

    def check_integrity(self, base_on_device: bool) -> None:
        for a in self.by_name.values():
            a.buffer.check_integrity()
            assert base_on_device or not a.resident, f"adapter {a.name} resident without its base"
            if a.slot is not None:
                assert self.slots[a.slot] is a.weights, f"adapter {a.name}'s slot"
        held = [a.slot for a in self.by_name.values() if a.slot is not None]
        assert len(held) == len(set(held)), "two adapters in one slot"

    def close(self) -> None:
        for name in list(self.by_name):
            self.remove(name)
