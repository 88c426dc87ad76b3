"""Where a model's KV blocks live inside its virtual buffer (DESIGN.md §3).

One logical page = one pool page (one physical handle). Inside it, layer l owns the l-th run of
`blocks_per_page` blocks; a block is [2, block_size, num_kv_heads, head_dim] (K then V). Treating
the buffer as one flat array of blocks, block `slot` of page p for layer 0 sits at global index
g = p * page_stride_blocks + slot, and layer l's view is that flat array shifted by
l * blocks_per_page blocks, so all layers share one block table with a uniform stride.

NOTE: pages sit `page_stride_bytes` apart in the virtual range, which is the page size rounded up
to a multiple of both the block size and the mapping granularity, so that block indices stay
integral for any head count (SmolLM2's 3 KV heads make a block of 3 * 2^k bytes). The gap between
pages is never mapped and never addressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_bytes: int  # one pool page
    granularity: int  # mapping granularity of the backend

    def __post_init__(self):
        if self.blocks_per_page < 1:
            raise ValueError(
                f"a page of {self.page_bytes} bytes cannot hold one block of {self.block_bytes} "
                f"bytes for each of {self.num_layers} layers; use larger pages or smaller blocks"
            )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def blocks_per_page(self) -> int:
        """Blocks (per layer) one page holds: the logical blocks a page adds to the model."""
        return self.page_bytes // (self.num_layers * self.block_bytes)

    @property
    def page_stride_bytes(self) -> int:
        step = math.lcm(self.block_bytes, self.granularity)
        return -(-self.page_bytes // step) * step

    @property
    def page_stride_blocks(self) -> int:
        return self.page_stride_bytes // self.block_bytes

    def block_index(self, page: int, slot: int) -> int:
        return page * self.page_stride_blocks + slot

    def locate(self, block: int) -> tuple[int, int]:
        """(page, slot) of a global block index."""
        page, slot = divmod(block, self.page_stride_blocks)
        assert slot < self.blocks_per_page, f"block {block} is not a layer-0 block"
        return page, slot

    def view_blocks(self, num_pages: int) -> int:
        """Rows in each layer's view of a buffer of num_pages pages (the same for every layer)."""
        return (num_pages - 1) * self.page_stride_blocks + self.blocks_per_page
