"""kvpool contract on the host backend: layout, mapping, placement, sharing, accounting."""

from __future__ import annotations

import random

import pytest
import torch

from kvpool import CpuBackend, KVCache, KVLayout, PagePool

PAGE = 256 * 1024


def make_pool(pages: int, page_bytes: int = PAGE) -> PagePool:
    return PagePool(CpuBackend(), page_bytes, budget_bytes=(pages + 1) * page_bytes)


def make_cache(
    pool: PagePool,
    owner: str,
    *,
    layers=3,
    heads=3,
    head_dim=16,
    block=4,
    max_pages=16,
    cached=1,
    dtype=torch.float32,
) -> KVCache:
    layout = KVLayout(
        layers, block, heads, head_dim, dtype, pool.page_bytes, pool.backend.granularity
    )
    return KVCache(pool, owner, layout, max_pages=max_pages, max_cached_pages=cached)


def check(*caches: KVCache) -> None:
    for c in caches:
        c.check_integrity()


def test_layout_odd_head_count_keeps_block_indices_integral():
    lay = KVLayout(30, 16, 3, 64, torch.float32, 64 << 20, 2 << 20)  # SmolLM2 shape, fp32
    assert lay.block_bytes == 2 * 16 * 3 * 64 * 4
    assert lay.page_stride_bytes % lay.block_bytes == 0
    assert lay.page_stride_bytes % (2 << 20) == 0
    assert lay.page_stride_bytes >= lay.page_bytes
    assert lay.blocks_per_page * lay.num_layers * lay.block_bytes <= lay.page_bytes
    assert lay.locate(lay.block_index(7, lay.blocks_per_page - 1)) == (7, lay.blocks_per_page - 1)
    with pytest.raises(ValueError, match="cannot hold one block"):
        KVLayout(64, 16, 8, 128, torch.bfloat16, 2 << 20, 2 << 20)


def test_every_layer_and_block_has_its_own_memory():
    pool = make_pool(8)
    kv = make_cache(pool, "m", max_pages=8)
    n = kv.allocator.bpp * 3
    blocks = kv.allocator.allocate(n)
    assert blocks is not None and len(set(blocks)) == n
    assert {kv.layout.locate(b)[0] for b in blocks} == {1, 2, 3}  # page 0 is never handed out
    for l, view in enumerate(kv.layer_views):
        assert view.shape[1:] == (2, 4, 3, 16)
        for i, b in enumerate(blocks):
            view[b] = l * 1000 + i
    for l, view in enumerate(kv.layer_views):
        for i, b in enumerate(blocks):
            assert torch.all(view[b] == l * 1000 + i), (l, b)
    kv.allocator.free(blocks)
    check(kv)
    kv.close()
    pool.check_integrity()


def test_best_fit_fills_partly_used_pages_and_unmaps_beyond_the_reserve():
    pool = make_pool(8)
    kv = make_cache(pool, "m", cached=1)
    a = kv.allocator
    bpp = a.bpp
    first = a.allocate(bpp + 2)  # page 1 full, page 2 has 2 used
    assert a.num_mapped_pages == 2
    a.free(first[:3])  # page 1 now has 3 free, page 2 has bpp-2 free
    extra = a.allocate(2)
    assert {kv.layout.locate(b)[0] for b in extra} == {1}  # fullest page with room first
    check(kv)
    a.free(first[3:] + extra)
    # both pages fully free: one stays cached, the other goes back to the pool
    assert a.num_used_blocks == 0 and a.num_mapped_pages == 1 and a.num_cached_pages == 1
    assert pool.pages_of("m") == 1
    check(kv)
    kv.close()
    pool.check_integrity()


def test_data_survives_on_mapped_pages_and_page_zero_stays_mapped():
    pool = make_pool(4)
    kv = make_cache(pool, "m", cached=0)
    blocks = kv.allocator.allocate(2)
    kv.layer_views[1][blocks[0]] = 7.0
    kv.layer_views[0][0] = 1.0  # the null block is always readable and writable
    other = kv.allocator.allocate(kv.allocator.bpp)  # forces a second page
    assert torch.all(kv.layer_views[1][blocks[0]] == 7.0)
    kv.allocator.free(other)
    assert torch.all(kv.layer_views[1][blocks[0]] == 7.0)
    kv.allocator.free(blocks)
    assert kv.allocator.num_mapped_pages == 0 and pool.pages_of("m") == 0
    check(kv)
    kv.close()


def test_allocation_beyond_the_budget_takes_nothing():
    pool = make_pool(3)
    kv = make_cache(pool, "m")
    bpp = kv.allocator.bpp
    held = kv.allocator.allocate(2 * bpp)
    assert kv.allocator.can_allocate(bpp) and not kv.allocator.can_allocate(bpp + 1)
    assert kv.allocator.allocate(bpp + 1) is None
    assert kv.allocator.num_used_blocks == 2 * bpp and pool.pages_of("m") == 2
    check(kv)
    kv.allocator.free(held)
    check(kv)
    kv.close()


def test_burst_of_one_model_is_served_by_pages_another_gave_back():
    pool = make_pool(10)
    a = make_cache(pool, "a", max_pages=16, cached=8)
    b = make_cache(pool, "b", max_pages=16, cached=8)
    bpp = a.allocator.bpp
    a_blocks = a.allocator.allocate(8 * bpp)  # A holds 8 of 10 pages
    assert not b.allocator.can_allocate(5 * bpp)
    a.allocator.free(a_blocks)  # A idles: its pages stay mapped as its cached reserve
    assert pool.pages_of("a") == 8 and pool.num_available == 2
    check(a, b)
    b_blocks = b.allocator.allocate(9 * bpp)  # B's burst takes 7 of A's pages
    assert b_blocks is not None
    assert pool.pages_of("b") == 9 and pool.pages_of("a") == 1
    check(a, b)
    b.allocator.free(b_blocks)
    check(a, b)
    a.close()
    b.close()
    pool.check_integrity()
    assert pool.stats().owned == {}


def test_random_alloc_free_keeps_accounting_exact():
    rng = random.Random(0)
    pool = make_pool(12)
    caches = [make_cache(pool, f"m{i}", max_pages=10, cached=rng.randint(0, 3)) for i in range(3)]
    held: list[list[tuple[KVCache, list[int]]]] = [[] for _ in caches]
    for _ in range(400):
        i = rng.randrange(3)
        kv = caches[i]
        if held[i] and rng.random() < 0.45:
            blocks = held[i].pop(rng.randrange(len(held[i])))
            kv.allocator.free(blocks)
        else:
            n = rng.randint(1, 2 * kv.allocator.bpp)
            ok = kv.allocator.can_allocate(n)
            blocks = kv.allocator.allocate(n)
            assert (blocks is not None) == ok
            if blocks:
                for b in blocks:
                    kv.layer_views[-1][b] = float(b)
                held[i].append(blocks)
        check(*caches)
    for i, kv in enumerate(caches):
        for blocks in held[i]:
            assert all(torch.all(kv.layer_views[-1][b] == float(b)) for b in blocks)
            kv.allocator.free(blocks)
        check(kv)
        kv.close()
    pool.check_integrity()
