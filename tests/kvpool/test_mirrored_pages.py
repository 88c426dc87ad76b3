"""MirroredPages: one block allocator over several shards' KV caches, each on its own pool (the
shards of a tensor-parallel model): a block means the same slot in every cache, pages are mapped
in every pool or in none, freed pages leave every pool, and every pool's accounting stays exact."""

from __future__ import annotations

import random

import torch

from kvpool import BlockAllocator, KVCache, KVLayout, MirroredPages
from tests.kvpool.test_kvpool import _cpu, fill, holds, make_pool


def _shards(pools, max_pages=8, cached=1):
    geo = _cpu()
    layout = KVLayout(
        2, 4, 2, geo.head_dim, torch.float32, geo.page_bytes, pools[0].backend.granularity
    )
    caches = [KVCache(p, "tp/kv", layout, max_pages) for p in pools]
    alloc = BlockAllocator(MirroredPages([c.pages for c in caches]), layout, max_pages, cached)
    caches[0].pages.set_reclaimer(alloc)  # the first shard's pool may take its idle pages back
    return caches, alloc


def _check(caches, alloc) -> None:
    alloc.check_integrity()
    for c in caches:
        c.check_integrity(alloc.mapped_pages())
        c.pages.pool.check_integrity()


def test_blocks_are_the_same_slots_in_every_shard_and_pages_move_together():
    geo = _cpu()
    pools = [make_pool(geo, 6), make_pool(geo, 6)]
    caches, alloc = _shards(pools)
    blocks = alloc.allocate(2 * alloc.bpp + 1)  # three pages in each pool
    assert [p.pages_of("tp/kv") for p in pools] == [3, 3]
    for i, c in enumerate(caches):  # each shard writes its own values to the same blocks
        fill(c.layer_views[1], blocks, [float(10 * i + b) for b in blocks])
    for i, c in enumerate(caches):
        assert holds(c.layer_views[1], blocks, [float(10 * i + b) for b in blocks])
    _check(caches, alloc)
    alloc.free(blocks)  # one page kept as the reserve, in both pools
    assert [p.pages_of("tp/kv") for p in pools] == [1, 1]
    _check(caches, alloc)
    alloc.release_all()
    assert [p.pages_of("tp/kv") for p in pools] == [0, 0]
    _check(caches, alloc)
    for c in caches:
        c.close()


def test_a_short_pool_maps_nothing_anywhere():
    geo = _cpu()
    pools = [make_pool(geo, 6), make_pool(geo, 2)]  # the second shard's device is fuller
    caches, alloc = _shards(pools)
    assert alloc.allocate(3 * alloc.bpp) is None  # 3 pages: the second pool has 2
    assert [p.pages_of("tp/kv") for p in pools] == [0, 0]
    got = alloc.allocate(2 * alloc.bpp)
    assert got is not None and [p.pages_of("tp/kv") for p in pools] == [2, 2]
    _check(caches, alloc)
    alloc.free(got)
    alloc.release_all()
    _check(caches, alloc)
    for c in caches:
        c.close()


def test_random_allocations_keep_every_pool_exact():
    geo = _cpu()
    pools = [make_pool(geo, 7) for _ in range(3)]
    caches, alloc = _shards(pools, cached=2)
    rng = random.Random(4)
    held: list[list[int]] = []
    for _ in range(300):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            got = alloc.allocate(rng.randint(1, 2 * alloc.bpp))
            if got is not None:
                held.append(got)
        assert len({p.pages_of("tp/kv") for p in pools}) == 1
    _check(caches, alloc)
    for b in held:
        alloc.free(b)
    alloc.release_all()
    _check(caches, alloc)
    assert all(p.pages_of("tp/kv") == 0 for p in pools)
    for c in caches:
        c.close()


def test_sharded_kv_takes_reserves_on_its_own_device_only():
    """The first shard's pool may take another model's idle pages back; the others give free
    pages only (their reserves are their own devices' threads' to give)."""
    from kvpool import ShardedKV
    from tests.kvpool.test_kvpool import make_cache

    geo = _cpu()
    pools = [make_pool(geo, 4), make_pool(geo, 4)]
    others = [make_cache(p, "other", geo, cached=3) for p in pools]
    for o in others:  # three idle pages kept as each one's reserve; one page free in each pool
        o.allocator.free(o.allocator.allocate(3 * o.allocator.bpp))
    assert [p.pages_of("other") for p in pools] == [3, 3]
    layout = KVLayout(
        2, 4, 2, geo.head_dim, torch.float32, geo.page_bytes, pools[0].backend.granularity
    )
    kv = ShardedKV(pools, "tp", layout, max_pages=8)
    bpp = kv.allocator.bpp
    assert kv.allocator.allocate(2 * bpp) is None  # the second pool would need other's reserve
    assert [p.pages_of("other") for p in pools] == [3, 3]  # nobody's reserve was touched
    one = kv.allocator.allocate(bpp)  # a free page in each pool
    assert one is not None and [p.pages_of("tp") for p in pools] == [1, 1]
    for o in others:  # the second device frees its reserve: now there is room
        o.allocator.release_all()
    two = kv.allocator.allocate(bpp)
    assert two is not None and [p.pages_of("tp") for p in pools] == [2, 2]
    kv.check_integrity()
    kv.allocator.free(one + two)
    kv.close()
    for o in others:
        o.check_integrity()
        o.close()
    for p in pools:
        p.check_integrity()
