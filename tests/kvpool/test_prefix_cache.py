"""The prefix cache in the block allocator: full blocks found again by content (exactly: a hash
collision gives no false hit), shared by reference, kept idle when no one uses them, evicted
least recently used (a chain's tail first) for the model's own allocations, and given back when
the pool reclaims pages for another model. Every test ends with the integrity check."""

from __future__ import annotations

import pytest

from kvpool import prefix_cache
from tests.kvpool.test_kvpool import _cpu, check, make_cache, make_pool

BLOCK = 4


def seq(n_blocks: int, start: int = 100) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK))


def run(kv, tokens: list[int], extra: int = 0) -> list[int]:
    """A request over `tokens`: takes the cached prefix, allocates the rest (+extra blocks),
    commits its full blocks; returns its block table (still held)."""
    a = kv.allocator
    hit = a.prefix.match(tokens, (len(tokens) - 1) // BLOCK)
    need = -(-len(tokens) // BLOCK) + extra - len(hit)
    table = hit + a.allocate(need)
    a.prefix.commit(table, tokens, 0, len(tokens) // BLOCK)
    return table


@pytest.fixture
def kv():
    geo = _cpu()
    pool = make_pool(geo, 10)
    kv = make_cache(pool, "m", geo, block=BLOCK, max_pages=12, cached=1)
    kv.allocator.prefix = prefix_cache.PrefixCache(
        BLOCK, lambda b: b // kv.layout.page_stride_blocks
    )
    yield kv
    check(kv)
    kv.close()
    pool.check_integrity()


def test_a_prefix_is_found_again_shared_and_kept_idle(kv):
    a = kv.allocator
    first = run(kv, seq(5))
    a.free(first)
    assert a.num_idle_blocks == 5 and a.num_used_blocks == 5  # idle blocks keep their content
    check(kv)
    tokens = seq(5) + [7, 8, 9, 10, 11]  # the same 5 blocks, a 6th full one, and a partial
    second = run(kv, tokens)
    assert second[:5] == first and a.num_idle_blocks == 0
    third = a.prefix.match(tokens, 6)  # shared by two requests now
    assert third == second[:6]
    a.free(third)
    assert a.num_idle_blocks == 0  # still used by the second
    a.free(second)
    assert a.num_idle_blocks == 6  # the 6th full block was cached too; the partial one freed
    assert a.prefix.match(seq(2) + [1, 2, 3, 4], 2) == first[:2]  # a shorter, diverging prompt
    a.free(first[:2])
    check(kv)


def test_a_hash_collision_gives_no_false_hit(kv, monkeypatch):
    monkeypatch.setattr(prefix_cache, "chain_key", lambda parent, tokens: 42)  # all collide
    a = kv.allocator
    a.free(run(kv, seq(3)))  # only its first block caches: the others' key is taken
    assert a.num_idle_blocks == 1
    assert a.prefix.match(seq(3, start=500), 3) == []  # other tokens, the same key
    hit = a.prefix.match(seq(3), 3)
    assert len(hit) == 1  # its own first block, and no further
    a.free(hit)


def test_the_parent_must_match_not_only_the_block(kv):
    a = kv.allocator
    a.free(run(kv, [1] * BLOCK + [2] * BLOCK))
    # the second block's tokens are cached, but after another first block
    assert a.prefix.match([3] * BLOCK + [2] * BLOCK, 2) == []


def test_free_pages_go_first_then_idle_blocks_as_many_as_needed_tail_first(kv):
    a = kv.allocator
    bpp = a.bpp
    chain = run(kv, seq(2 * bpp))  # 2 of the pool's 10 pages
    a.free(chain)
    assert a.num_idle_blocks == 2 * bpp
    check(kv)
    big = a.allocate(8 * bpp + 1)  # the 8 free pages, then one block of the cache
    assert big is not None and a.num_idle_blocks == 2 * bpp - 1
    assert chain[-1] not in a.prefix.idle and chain[0] in a.prefix.idle
    check(kv)
    a.free(big)
    everything = a.allocate(10 * bpp)  # the whole pool: every idle block goes
    assert everything is not None and a.num_idle_blocks == 0
    a.free(everything)


def test_the_pool_reclaims_pages_holding_only_idle_blocks_for_another_model():
    geo = _cpu()
    pool = make_pool(geo, 10)
    a = make_cache(pool, "a", geo, block=BLOCK, max_pages=12, cached=1, prefix=True)
    b = make_cache(pool, "b", geo, block=BLOCK, max_pages=12, cached=1, prefix=True)
    bpp = a.allocator.bpp
    a.allocator.free(run(a, seq(8 * bpp)))  # A's 8 pages hold only idle cached blocks
    assert pool.pages_of("a") == 8 and a.allocator.reclaimable_pages() == 8
    check(a, b)
    blocks = b.allocator.allocate(9 * bpp)  # B's burst: 2 free pages, 7 reclaimed from A's cache
    assert blocks is not None and pool.pages_of("b") == 9 and pool.pages_of("a") == 1
    assert a.allocator.num_idle_blocks == bpp  # A kept one page of its cache
    check(a, b)
    b.allocator.free(blocks)
    for kv in (a, b):
        kv.close()
    pool.check_integrity()
    assert pool.stats().owned == {}
