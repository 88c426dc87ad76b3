"""The prefix cache of one model: full KV blocks found again by their content.

A full block is known by a chain key, hash(the previous block's key, its token ids), so that one
key stands for the whole prefix up to it; a lookup checks the stored token ids and the parent
block too, so that a hash collision cannot give a false hit (a match is exact by induction).
Cached blocks may be shared by several requests (reference counts); a cached block nobody uses
stays where it is, as an idle block, until its page is needed: the allocator evicts idle blocks,
least recently used first (a chain's tail before its head), for its own model's allocations and
when the pool reclaims pages for another model, before any request is preempted.

Bookkeeping only: the allocator owns the slots and calls this.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

_ROOT = 0x5EED  # the parent key of a sequence's first block


def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
    """The key of a block: its parent's key and its token ids, hashed."""
    return hash((parent_key, tokens))


@dataclass(frozen=True)
class _Entry:
    key: int
    parent: int  # the block before it in its prefix (-1: the first)
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, block_size: int, page_of):
        """page_of(block): the page a block lives on (idle blocks are counted per page)."""
        self.block_size = block_size
        self._page_of = page_of
        self.idle_on_page: dict[int, int] = {}  # page -> its idle blocks
        self._by_key: dict[int, int] = {}  # chain key -> block
        self._entries: dict[int, _Entry] = {}  # cached block -> what it holds
        self._refs: dict[int, int] = {}  # cached block -> requests using it
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks in no use, LRU first
        self.evictions = 0  # idle blocks evicted since start (their pages were needed)

    def _chunk(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    # ---- requests -------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest prefix of `tokens` (at most max_blocks full
        blocks), each taken for one more user."""
        out: list[int] = []
        parent, key = -1, _ROOT
        for i in range(max_blocks):
            chunk = self._chunk(tokens, i)
            key = chain_key(key, chunk)
            b = self._by_key.get(key)
            e = self._entries.get(b) if b is not None else None
            if e is None or e.tokens != chunk or e.parent != parent:
                break
            out.append(b)
            parent = b
        for b in out:
            self._refs[b] += 1
            if b in self.idle:  # no longer idle
                del self.idle[b]
                self._count(b, -1)
        return out

    def _count(self, block: int, d: int) -> None:
        p = self._page_of(block)
        n = self.idle_on_page.get(p, 0) + d
        if n:
            self.idle_on_page[p] = n
        else:
            del self.idle_on_page[p]

    def commit(self, blocks: list[int], tokens: list[int], first: int, end: int) -> None:
        """Blocks first..end-1 of a request's table are now full of its tokens' K/V: cache
        them (each with the one user it has). A prefix whose block is not cached (another
        request holds the same content) is not continued."""
        for i in range(first, end):
            b = blocks[i]
            if b in self._entries:
                continue
            parent = blocks[i - 1] if i else -1
            if i and parent not in self._entries:
                return
            chunk = self._chunk(tokens, i)
            key = chain_key(self._entries[parent].key if i else _ROOT, chunk)
            if key in self._by_key:
                return
            self._by_key[key] = b
            self._entries[b] = _Entry(key, parent, chunk)
            self._refs[b] = 1

    def release(self, blocks: list[int]) -> list[int]:
        """A request lets go of `blocks`: the cached ones lose a user (idle at none, the tail
        first in line for eviction); returns the others, to be freed."""
        free = []
        for b in reversed(blocks):
            if b in self._entries:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self.idle[b] = None
                    self._count(b, 1)
            else:
                free.append(b)
        return free

    def evict(self, block: int) -> None:
        """Forget an idle block (its slot is freed by the caller)."""
        e = self._entries.pop(block)
        del self._by_key[e.key], self._refs[block], self.idle[block]
        self._count(block, -1)
        self.evictions += 1

    # ---- checks ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        assert len(self._by_key) == len(self._entries) == len(self._refs)
        for key, b in self._by_key.items():
            assert self._entries[b].key == key, b
        for b, n in self._refs.items():
            assert n >= 0 and (n == 0) == (b in self.idle), (b, n)
        assert set(self.idle) <= set(self._entries)
        per_page: dict[int, int] = {}
        for b in self.idle:
            per_page[self._page_of(b)] = per_page.get(self._page_of(b), 0) + 1
        assert per_page == self.idle_on_page, (per_page, self.idle_on_page)
