"""A model's weights as one pooled buffer: every parameter is a fixed view into a virtual range
whose pages come from the device's page pool (the same pool and page size as the KV caches).

The layout packs the parameters back to back (each aligned), so the whole model is
`layout.nbytes` contiguous bytes: the host copy has the same layout and activation is a few large
copies. Addresses never change, so views, the model bound to them and CUDA graphs captured over
them stay valid while the pages are unmapped (evicted) and mapped again (activated). While
unmapped, the views must not be touched (a fault). Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvpool.host_copy import Transfer
from kvpool.page_pool import PagePool
from kvpool.pooled_buffer import PooledBuffer

ALIGN = 256  # bytes; every tensor starts at a multiple (vectorized kernels want >= 16)


@dataclass(frozen=True)
class WeightSlot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the buffer

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class WeightLayout:
    slots: tuple[WeightSlot, ...]
    nbytes: int  # end of the last tensor

    @classmethod
    def pack(cls, tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> WeightLayout:
        """(name, shape, dtype) in order -> back-to-back slots, each ALIGN-aligned."""
        slots, end = [], 0
        for name, shape, dtype in tensors:
            offset = -(-end // ALIGN) * ALIGN
            slot = WeightSlot(name, tuple(shape), dtype, offset)
            slots.append(slot)
            end = offset + slot.nbytes
        return cls(tuple(slots), end)

    def num_pages(self, page_bytes: int) -> int:
        return max(1, -(-self.nbytes // page_bytes))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> a tensor of the slot's shape and dtype over `flat`'s bytes (uint8, at least
        nbytes of them): the layout over any buffer (a host copy, say)."""
        if flat.dtype != torch.uint8 or flat.numel() < self.nbytes:
            raise ValueError(f"a layout of {self.nbytes} bytes over {flat.numel()} {flat.dtype}")
        return {s.name: _view(flat, s) for s in self.slots}


class WeightBuffer:
    def __init__(self, pool: PagePool, owner: str, layout: WeightLayout, reclaim: bool = True):
        """reclaim False: mapped from free pages only (see PooledBuffer)."""
        self.layout = layout
        self.num_pages = layout.num_pages(pool.page_bytes)
        self.pages = PooledBuffer(
            pool, owner, self.num_pages, pool.page_bytes, kind="weights", reclaim=reclaim
        )
        self._flat = self.pages.view()  # uint8 over the whole range

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def mapped(self) -> bool:
        return self.pages.num_mapped_pages == self.num_pages

    def can_map(self) -> bool:
        return self.mapped or self.pages.can_map(self.num_pages)

    def map(self) -> bool:
        """Back every page (one batched map); False, nothing mapped, if the pool has too few."""
        if self.mapped:
            return True
        return self.pages.map_pages(list(range(self.num_pages)))

    def unmap(self) -> None:
        """Give every page back to the pool (the views stay, unbacked)."""
        if self.pages.num_mapped_pages:
            self.pages.unmap_pages(self.pages.mapped_pages())

    def bytes(self) -> torch.Tensor:
        """The whole layout as one uint8 tensor (zero-copy; valid while mapped)."""
        return self._flat[: self.layout.nbytes]

    def views(self) -> dict[str, torch.Tensor]:
        """name -> a tensor of the slot's shape and dtype over its bytes (zero-copy)."""
        return self.layout.views(self._flat)

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        assert self.pages.num_mapped_pages in (0, self.num_pages), "partly mapped weights"

    def close(self) -> None:
        self.pages.close()


def _view(flat: torch.Tensor, slot: WeightSlot) -> torch.Tensor:
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def map_and_load(buffer, host) -> Transfer | None:
    """Back every page of `buffer` (a WeightBuffer, or a sharded model's ShardedWeights) and
    start `host`'s copy of its bytes into them (its HostCopy, or ShardedHostCopy): the copy in
    flight, or None (nothing mapped) when the pool has too few pages; a copy that cannot start
    leaves the pages unmapped."""
    if not buffer.map():
        return None
    try:
        return host.load_async(buffer.bytes())
    except BaseException:
        buffer.unmap()
        raise
