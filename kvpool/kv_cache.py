"""One model's paged KV cache: storage only. A pooled buffer (pages from the device's pool), page 0
backed by the pool's shared null page, and the per-layer views the attention backends read.
Which pages are mapped is the block allocator's decision, made through `pages` (a PageMapper)."""

from __future__ import annotations

import torch

from kvpool.kv_layout import KVLayout
from kvpool.page_pool import PagePool
from kvpool.pooled_buffer import PooledBuffer


class KVCache:
    """Invariants: page 0 is always mapped (to the pool's shared null page) and its blocks are
    never handed out, so padded slots (block 0) always read mapped memory."""

    def __init__(
        self, pool: PagePool, owner: str, layout: KVLayout, max_pages: int, reclaim: bool = True
    ):
        if max_pages < 2:
            raise ValueError("a KV cache needs at least 2 pages (page 0 is the null page)")
        self.layout = layout
        self.max_pages = max_pages
        self.pages = PooledBuffer(pool, owner, max_pages, layout.page_stride_bytes, reclaim=reclaim)
        self.pages.map_null(0)
        n = layout.view_blocks(max_pages)
        # [num_blocks, 2, block_size, kv_heads, head_dim] over the whole range
        flat = self.pages.view(layout.dtype).view(
            -1, 2, layout.block_size, layout.num_kv_heads, layout.head_dim
        )
        bpp = layout.blocks_per_page
        self.layer_views: list[torch.Tensor] = [
            flat[l * bpp : l * bpp + n] for l in range(layout.num_layers)
        ]

    @property
    def capacity_blocks(self) -> int:
        """Blocks the cache holds with every page mapped (page 0 excluded)."""
        return (self.max_pages - 1) * self.layout.blocks_per_page

    @property
    def mapped_bytes(self) -> int:
        return self.pages.mapped_bytes

    def check_integrity(self, allocated_pages: list[int] | None = None) -> None:
        """Mapping, pool accounting and (if given) the allocator's mapped pages agree."""
        self.pages.check_integrity(allocated_pages)

    def close(self) -> None:
        self.pages.close()
