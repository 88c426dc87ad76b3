"""Block placement over one model's pages: the only policy kvpool holds (storage lives in KVCache,
mapping goes through a PageMapper, which pages other models get back is the pool's reclaim order).

- Blocks are handed out only from mapped pages; page 0 is never used.
- Best fit: a request for blocks fills the mapped page with the fewest free blocks first, so load
  concentrates and idle models can give whole pages back.
- A new logical page is mapped on demand when mapped pages run short.
- A page whose blocks are all free is kept mapped as the model's cached reserve (up to
  `max_cached_pages`, for the next burst) or unmapped and returned to the pool. Other models can
  reclaim the cached reserve through the pool (`reclaim_pages`: the allocator is the pool's
  Reclaimer for its owner).
Not thread-safe: the device's engine thread owns it.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from kvpool.kv_layout import KVLayout
from kvpool.prefix_cache import PrefixCache


class PageMapper(Protocol):
    """Maps and unmaps whole pages of one owner's buffer (a PooledBuffer)."""

    def can_map(self, n: int) -> bool: ...

    def map_pages(self, pages: list[int]) -> bool:
        """Back each page index with a pool page; False (nothing mapped) if there are too few."""

    def unmap_pages(self, pages: list[int]) -> None: ...


class BlockAllocator:
    def __init__(
        self,
        pages: PageMapper,
        layout: KVLayout,
        max_pages: int,
        max_cached_pages: int,
        prefix_caching: bool = False,
    ):
        """prefix_caching: full blocks are kept by content for later requests (`prefix`)."""
        self.pages = pages
        self.layout = layout
        self.bpp = layout.blocks_per_page
        self.max_pages = max_pages
        self.max_cached_pages = max_cached_pages
        self._free_slots: dict[int, list[int]] = {}  # mapped page -> free slots (stack)
        self._unmapped = list(range(max_pages - 1, 0, -1))  # stack: lowest page index on top
        self._num_used = 0
        self._num_cached = 0  # mapped pages whose blocks are all free
        self.quota_pages: int | None = None  # the most pages it may map (None: max_pages - 1)
        stride = layout.page_stride_blocks
        self.prefix = (
            PrefixCache(layout.block_size, lambda b: b // stride) if prefix_caching else None
        )

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_mapped_pages(self) -> int:
        return len(self._free_slots)

    def mapped_pages(self) -> list[int]:
        return sorted(self._free_slots)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_free_blocks(self) -> int:
        """Free blocks on mapped pages (cached pages included)."""
        return self.num_mapped_pages * self.bpp - self._num_used

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def capacity_blocks(self) -> int:
        """Blocks this model could hold if it had every page it can address (within its
        quota)."""
        return self._max_mapped * self.bpp

    @property
    def _max_mapped(self) -> int:
        cap = self.max_pages - 1
        return cap if self.quota_pages is None else min(cap, self.quota_pages)

    def set_quota(self, pages: int | None) -> None:
        """Cap the pages it maps (a fixed partition); mapped pages above a new cap stay until
        their blocks are freed and the pages are reclaimed."""
        self.quota_pages = pages

    def _pages_needed(self, n: int) -> int:
        return max(0, -(-(n - self.num_free_blocks) // self.bpp))

    def _within_quota(self, pages: int) -> bool:
        return pages <= len(self._unmapped) and self.num_mapped_pages + pages <= self._max_mapped

    def can_allocate(self, n: int) -> bool:
        """Whether n blocks could be had now (evicting idle cached blocks if need be)."""
        if self._can_allocate(n):
            return True
        return self.num_idle_blocks > 0 and self._can_allocate(n - self.num_idle_blocks)

    def _can_allocate(self, n: int) -> bool:
        pages = self._pages_needed(n)
        if pages == 0:
            return True
        return self._within_quota(pages) and self.pages.can_map(pages)

    @property
    def num_idle_blocks(self) -> int:
        """Cached blocks no request uses (counted as used: they hold their content)."""
        return len(self.prefix.idle) if self.prefix is not None else 0

    # ---- allocate / free ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n global block indices, or None (nothing taken) if the pages cannot be had: free
        blocks, then new pages (the pool's free ones, then other owners' reserves), then this
        model's idle cached blocks, least recently used first."""
        out = self._allocate(n)
        if out is None and self.num_idle_blocks:
            idle = self.prefix.idle
            while idle and not self._can_allocate(n):
                self._drop([next(iter(idle))])
            out = self._allocate(n)
        return out

    def _drop(self, blocks: list[int]) -> None:
        """Evict idle cached blocks: their slots become free (their pages stay mapped)."""
        for b in blocks:
            self.prefix.evict(b)
        self._return(blocks)

    def _allocate(self, n: int) -> list[int] | None:
        pages = self._pages_needed(n)
        if pages:
            if not self._within_quota(pages):
                return None
            new = [self._unmapped.pop() for _ in range(pages)]
            if not self.pages.map_pages(new):
                self._unmapped.extend(reversed(new))
                return None
            for p in new:
                self._free_slots[p] = list(range(self.bpp - 1, -1, -1))
            self._num_cached += len(new)
        # best fit: pages with the fewest free slots first (then the lowest index). Every page but
        # the last one taken is emptied, so one ordering serves the whole request: a heap makes
        # that O(P + k log P) for k pages touched, instead of a scan of every page per page taken.
        heap = [(len(s), p) for p, s in self._free_slots.items() if s]
        heapq.heapify(heap)
        stride = self.layout.page_stride_blocks
        out: list[int] = []
        while len(out) < n:
            free, page = heapq.heappop(heap)
            slots = self._free_slots[page]
            if free == self.bpp:
                self._num_cached -= 1
            take = min(free, n - len(out))
            base = page * stride
            if take == self.bpp:  # a whole free page: its blocks in order, in one go
                out.extend(range(base, base + take))
                slots.clear()
            else:
                out.extend(base + s for s in reversed(slots[free - take :]))
                del slots[free - take :]
        self._num_used += n
        return out

    def free(self, blocks: list[int]) -> None:
        """A request's blocks back: cached ones stay (idle when no one else uses them), the
        rest are freed; pages emptied beyond the cached reserve are unmapped."""
        if self.prefix is not None:
            blocks = self.prefix.release(blocks)
        emptied = self._return(blocks)
        excess = self.num_cached_pages - self.max_cached_pages
        if excess > 0 and emptied:
            self._unmap(emptied[-excess:] if excess < len(emptied) else emptied)

    def _return(self, blocks: list[int]) -> list[int]:
        """Slots back to their pages; returns the pages this emptied."""
        emptied = []
        stride, bpp, free_slots = self.layout.page_stride_blocks, self.bpp, self._free_slots
        for b in blocks:
            page, slot = divmod(b, stride)
            if slot >= bpp:
                raise ValueError(f"block {b} is not a layer-0 block")
            slots = free_slots[page]
            slots.append(slot)
            if len(slots) == bpp:
                emptied.append(page)
        self._num_used -= len(blocks)
        self._num_cached += len(emptied)
        return emptied

    def _unmap(self, pages: list[int]) -> None:
        """pages: fully free ones."""
        self.pages.unmap_pages(pages)
        for p in pages:
            del self._free_slots[p]
        self._num_cached -= len(pages)
        self._unmapped.extend(pages)
        self._unmapped.sort(reverse=True)

    # ---- the pool's Reclaimer -------------------------------------------------------------------
    def reclaimable_pages(self) -> int:
        return self.num_cached_pages + len(self._idle_pages())

    def _idle_pages(self) -> list[int]:
        """Pages whose used blocks are all idle cached ones (evicting them empties the page)."""
        if self.prefix is None:
            return []
        return [
            p
            for p, n in self.prefix.idle_on_page.items()
            if n == self.bpp - len(self._free_slots[p])
        ]

    def reclaim_pages(self, n: int) -> int:
        """Unmap up to n pages and give them to the pool: fully free ones (highest page index
        first), then pages holding only idle cached blocks (those evicted)."""
        cached = sorted(
            (p for p, s in self._free_slots.items() if len(s) == self.bpp), reverse=True
        )[:n]
        if len(cached) < n and self.prefix is not None:
            pages = set(sorted(self._idle_pages(), reverse=True)[: n - len(cached)])
            stride = self.layout.page_stride_blocks
            self._drop([b for b in self.prefix.idle if b // stride in pages])
            cached += sorted(pages)
        if cached:
            self._unmap(cached)
        return len(cached)

    def release_all(self) -> None:
        if self.num_idle_blocks:
            self._drop(list(self.prefix.idle))
        if self._num_used:
            raise RuntimeError(f"{self._num_used} blocks are still in use")
        self.reclaim_pages(len(self._free_slots))

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free = sum(len(s) for s in self._free_slots.values())
        assert free + self._num_used == self.num_mapped_pages * self.bpp, (free, self._num_used)
        for p, slots in self._free_slots.items():
            assert 0 < p < self.max_pages, p
            assert len(set(slots)) == len(slots) and all(0 <= s < self.bpp for s in slots), p
        assert not set(self._unmapped) & set(self._free_slots)
        assert len(self._unmapped) + self.num_mapped_pages == self.max_pages - 1
        cached = sum(len(s) == self.bpp for s in self._free_slots.values())
        assert cached == self._num_cached, (cached, self._num_cached)
        assert self.num_cached_pages <= self.max_cached_pages, self.num_cached_pages
        if self.prefix is not None:
            self.prefix.check_integrity()
            stride = self.layout.page_stride_blocks
            for b in self.prefix._entries:
                page, slot = divmod(b, stride)
                assert slot not in self._free_slots[page], f"cached block {b} is free"
