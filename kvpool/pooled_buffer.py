"""A virtual buffer whose physical pages come from the device's page pool, under one owner.

The buffer is `num_pages` slots of `page_stride` bytes; slot p starts at p * page_stride and holds
one pool page (the stride may exceed the page size: the gap is never mapped nor addressed). Both
a model's KV cache and its weight buffer are one of these. Which slots to map is decided above
(the block allocator for KV); this object only maps, unmaps and keeps the accounting exact.
Not thread-safe: the device's engine thread owns it (the pool itself is locked).
"""

from __future__ import annotations

import torch

from kvpool.page_pool import PagePool, Reclaimer
from kvpool.virtual_buffer import VirtualBuffer


class PooledBuffer:
    def __init__(
        self,
        pool: PagePool,
        owner: str,
        num_pages: int,
        page_stride: int,
        kind: str = "kv",
        reclaim: bool = True,
    ):
        """reclaim False: it maps free pages only, never another owner's reserve (a buffer
        mapped from a thread other than the one that owns the pool's other owners)."""
        if page_stride < pool.page_bytes or page_stride % pool.backend.granularity:
            raise ValueError(f"page stride {page_stride} does not fit pages of {pool.page_bytes}")
        self.pool, self.owner, self.reclaim = pool, owner, reclaim
        self.num_pages, self.page_stride = num_pages, page_stride
        self.buffer = VirtualBuffer(pool.backend, num_pages * page_stride)
        self._owned: set[int] = set()  # slots mapped to pages this owner holds
        self._shared: set[int] = set()  # slots mapped to the pool's null page
        pool.register(owner, kind=kind)

    def set_reclaimer(self, reclaim: Reclaimer | None) -> None:
        """Who the pool asks when another owner needs pages (see PagePool)."""
        self.pool.set_reclaimer(self.owner, reclaim)

    # ---- the PageMapper interface (what a placement policy calls) ------------------------------
    def can_map(self, n: int) -> bool:
        return self.pool.can_acquire(self.owner, n, self.reclaim)

    def map_pages(self, pages: list[int]) -> bool:
        """Map a fresh pool page at each slot; False (nothing mapped) if the pool has too few."""
        self._check_free(pages)
        handles = self.pool.acquire(self.owner, len(pages), self.reclaim)
        if handles is None:
            return False
        try:
            self.buffer.map_many([(p * self.page_stride, h) for p, h in zip(pages, handles)])
        except BaseException:
            self.pool.release(self.owner, handles)
            raise
        self._owned.update(pages)
        return True

    def unmap_pages(self, pages: list[int]) -> None:
        """Unmap the slots and give their pages back to the pool."""
        if not self._owned.issuperset(pages) or len(set(pages)) != len(pages):
            raise RuntimeError(f"slots {sorted(set(pages) - self._owned)} are not mapped")
        handles = self.buffer.unmap_many([p * self.page_stride for p in pages])
        self._owned.difference_update(pages)
        self.pool.release(self.owner, handles)

    def map_null(self, page: int) -> None:
        """Back a slot by the pool's shared null page (not counted as this owner's)."""
        self._check_free([page])
        self.buffer.map(page * self.page_stride, self.pool.null_handle)
        self._shared.add(page)

    def _check_free(self, pages: list[int]) -> None:
        taken = self._owned | self._shared
        bad = [p for p in pages if not 0 <= p < self.num_pages or p in taken]
        if bad or len(set(pages)) != len(pages):
            raise RuntimeError(f"slots {bad or pages} are taken or out of range")

    # ---- accounting -----------------------------------------------------------------------------
    @property
    def num_mapped_pages(self) -> int:
        """Pool pages this owner holds here (null-backed slots excluded)."""
        return len(self._owned)

    def mapped_pages(self) -> list[int]:
        return sorted(self._owned)

    @property
    def mapped_bytes(self) -> int:
        return len(self._owned) * self.pool.page_bytes

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return self.buffer.view(dtype)

    def check_integrity(self, expected: list[int] | None = None) -> None:
        """What is mapped is exactly what is accounted (and `expected`, if given)."""
        mapped = set(self.buffer.mapped_offsets())
        want = {p * self.page_stride for p in self._owned | self._shared}
        assert mapped == want, (sorted(mapped), sorted(want))
        assert not self._owned & self._shared
        assert self.pool.pages_of(self.owner) == len(self._owned), (
            self.pool.pages_of(self.owner),
            len(self._owned),
        )
        if expected is not None:
            assert set(expected) == self._owned, (sorted(expected), sorted(self._owned))
        self.pool.check_integrity()

    def close(self) -> None:
        """Give every page back and free the address range."""
        if self._owned:
            self.unmap_pages(sorted(self._owned))
        self.pool.unregister(self.owner)
        self.buffer.close()
        self._shared.clear()
