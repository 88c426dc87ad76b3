"""A model's KV storage and its block placement, composed: a KVCache, a BlockAllocator over its
pages, and the allocator registered as the pool's reclaimer for the owner. Neither part knows the
other; this is the one place that wires them."""

from __future__ import annotations

import torch

from kvpool.block_allocator import BlockAllocator
from kvpool.kv_cache import KVCache
from kvpool.kv_layout import KVLayout
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
        self.cache = KVCache(pool, owner, layout, max_pages=max_pages)
        self.allocator = BlockAllocator(
            self.cache.pages, layout, max_pages, max_cached_pages, prefix_caching
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
        self.cache.check_integrity(self.allocator.mapped_pages())

    def close(self) -> None:
        """Unmaps everything (no block may be in use) and frees the address range."""
        self.cache.pages.set_reclaimer(None)
        self.allocator.release_all()
        self.cache.close()
