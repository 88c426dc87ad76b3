"""A model's KV storage and its block placement, composed: a KVCache, a BlockAllocator over its
pages, and the allocator registered as the pool's reclaimer for the owner. Neither part knows the
other; this is the one place that wires them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.block_allocator import BlockAllocator
from kvpool.kv_cache import KVCache
from kvpool.kv_layout import KVLayout
from kvpool.mirrored_pages import MirroredPages
from kvpool.page_pool import PagePool


class PagedKV:
    def __init__(
        self,
        pool: PagePool,
        owner: str,
        layout: KVLayout,
        max_pages: int,
        max_cached_pages: int = 1,
        prefix_caching: bool = False,
    ):
        self._wire(
            [KVCache(pool, owner, layout, max_pages=max_pages)],
            max_pages,
            max_cached_pages,
            prefix_caching,
        )

    def _wire(self, caches, max_pages, max_cached_pages, prefix_caching) -> None:
        """One block allocator over the caches' pages (mirrored when there are several), and
        the first cache's pool told to ask it for idle pages."""
        self.caches = caches
        self.cache = caches[0]
        pages = caches[0].pages if len(caches) == 1 else MirroredPages([c.pages for c in caches])
        self.allocator = BlockAllocator(
            pages, self.cache.layout, max_pages, max_cached_pages, prefix_caching
        )
        self.cache.pages.set_reclaimer(self.allocator)

    @property
    def layout(self) -> KVLayout:
        return self.cache.layout

    @property
    def layer_views(self) -> list[torch.Tensor]:
        return self.cache.layer_views

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        for c in self.caches:
            c.check_integrity(self.allocator.mapped_pages())

    def close(self) -> None:
        """Unmaps everything (no block may be in use) and frees the address range."""
        self.cache.pages.set_reclaimer(None)
        self.allocator.release_all()
        for c in self.caches:
            c.close()


class ShardedKV(PagedKV):
    """The KV storage of a model split over several devices (tensor parallelism): a KVCache per
    shard, each on its device's pool and holding that shard's KV heads, and one block allocator
    whose pages are mapped in all of them (MirroredPages), so a block is the same slot in every
    shard. The first pool is the model's own device's: its engine thread steps the model, and its
    balloon may take the idle pages back (from every shard). The other pools give free pages
    only: their reserves belong to their own devices' threads."""

    def __init__(
        self,
        pools: Sequence[PagePool],
        owner: str,
        layout: KVLayout,
        max_pages: int,
        max_cached_pages: int = 1,
        prefix_caching: bool = False,
    ):
        caches = [KVCache(p, owner, layout, max_pages, reclaim=i == 0) for i, p in enumerate(pools)]
        self._wire(caches, max_pages, max_cached_pages, prefix_caching)
