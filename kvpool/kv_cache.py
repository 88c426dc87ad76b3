"""One model's paged KV cache: storage (a virtual buffer whose pages come from the pool) plus the
per-layer views the attention backends read, and the block allocator that decides placement."""

from __future__ import annotations

import torch

from kvpool.block_allocator import BlockAllocator
from kvpool.kv_layout import KVLayout
from kvpool.page_pool import PagePool
from kvpool.virtual_buffer import VirtualBuffer


class KVCache:
    """Invariants: page 0 is always mapped (to the pool's shared null page) and its blocks are
    never handed out, so padded slots (block 0) always read mapped memory; any other page is
    mapped exactly while the allocator counts it as mapped."""

    def __init__(
        self,
        pool: PagePool,
        owner: str,
        layout: KVLayout,
        max_pages: int,
        max_cached_pages: int = 1,
    ):
        if max_pages < 2:
            raise ValueError("a KV cache needs at least 2 pages (page 0 is the null page)")
        self.pool, self.owner, self.layout = pool, owner, layout
        self.buffer = VirtualBuffer(pool.backend, max_pages * layout.page_stride_bytes)
        self.buffer.map(0, pool.null_handle)
        n = layout.view_blocks(max_pages)
        # [num_blocks, 2, block_size, kv_heads, head_dim] over the whole range
        flat = self.buffer.view(layout.dtype).view(
            -1, 2, layout.block_size, layout.num_kv_heads, layout.head_dim
        )
        bpp = layout.blocks_per_page
        self.layer_views: list[torch.Tensor] = [
            flat[l * bpp : l * bpp + n] for l in range(layout.num_layers)
        ]
        self.allocator = BlockAllocator(self, layout, max_pages, max_cached_pages)
        pool.register(owner, self.allocator)

    # ---- storage operations the allocator calls -------------------------------------------------
    def map_pages(self, pages: list[int]) -> bool:
        handles = self.pool.acquire(self.owner, len(pages))
        if handles is None:
            return False
        stride = self.layout.page_stride_bytes
        try:
            self.buffer.map_many([(p * stride, h) for p, h in zip(pages, handles)])
        except BaseException:
            self.pool.release(self.owner, handles)
            raise
        return True

    def unmap_pages(self, pages: list[int]) -> None:
        stride = self.layout.page_stride_bytes
        self.pool.release(self.owner, self.buffer.unmap_many([p * stride for p in pages]))

    def can_map(self, n: int) -> bool:
        return self.pool.can_acquire(self.owner, n)

    # ---- accounting -----------------------------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        return self.allocator.num_mapped_pages * self.pool.page_bytes

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        mapped = set(self.buffer.mapped_offsets())
        stride = self.layout.page_stride_bytes
        expect = {0} | {p * stride for p in self.allocator.mapped_pages()}
        assert mapped == expect, (sorted(mapped), sorted(expect))
        assert self.pool.pages_of(self.owner) == self.allocator.num_mapped_pages
        self.pool.check_integrity()

    def close(self) -> None:
        self.allocator.release_all()
        self.pool.unregister(self.owner)
        self.buffer.close()
