"""The same pages mapped in several buffers at once: the KV caches of a tensor-parallel model's
shards (one per device, each holding its KV heads) share one block allocator, so a block id means
the same slot in every shard's cache. MirroredPages is that allocator's PageMapper: it maps a page
index in every buffer or in none, and unmaps it in all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvpool.block_allocator import PageMapper

T = TypeVar("T")


def map_all(
    parts: Sequence[T], map_one: Callable[[T], bool], unmap_one: Callable[[T], None]
) -> bool:
    """map_one on every part, or on none: the ones done are undone if one fails (False)."""
    done: list[T] = []
    try:
        for p in parts:
            if not map_one(p):
                break
            done.append(p)
    finally:
        if len(done) < len(parts):
            for p in done:
                unmap_one(p)
    return len(done) == len(parts)


class MirroredPages:
    """mappers[0] is the first shard's buffer; the others follow it page for page."""

    def __init__(self, mappers: Sequence[PageMapper]):
        if not mappers:
            raise ValueError("MirroredPages needs at least one buffer")
        self.mappers = list(mappers)

    def can_map(self, n: int) -> bool:
        return all(m.can_map(n) for m in self.mappers)

    def map_pages(self, pages: list[int]) -> bool:
        """Map the pages in every buffer; False (nothing mapped anywhere) if one is short. Each
        is asked first, so no pool takes another owner's reserve for pages it then gives back."""
        if not self.can_map(len(pages)):
            return False
        return map_all(self.mappers, lambda m: m.map_pages(pages), lambda m: m.unmap_pages(pages))

    def unmap_pages(self, pages: list[int]) -> None:
        for m in self.mappers:
            m.unmap_pages(pages)
