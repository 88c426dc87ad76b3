"""kvpool contract on every backend: layout, mapping, placement, sharing, accounting.

Each test runs on the host backend (always) and on the CUDA VMM backend (marked gpu; skipped
without CUDA). The CUDA granularity is 2 MiB against 4 KiB on the host, so its pages are 8x larger
and its blocks 8x wider (head_dim): the same number of blocks per page, the same placements.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kvpool import CpuBackend, KVLayout, MemoryBackend, PagedKV, PagePool

PAGE = 256 * 1024


@dataclass(frozen=True)
class Geometry:
    backend: MemoryBackend
    page_bytes: int
    head_dim: int


def _cpu() -> Geometry:
    return Geometry(CpuBackend(), PAGE, 16)


def _cuda() -> Geometry:
    from kvpool import CudaBackend

    return Geometry(CudaBackend("cuda"), 8 * PAGE, 128)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = [
    pytest.param(_cpu, id="cpu"),
    pytest.param(_cuda, id="cuda", marks=[pytest.mark.gpu, needs_cuda]),
]


@pytest.fixture(params=BACKENDS)
def geo(request) -> Geometry:
    return request.param()


def in_given_order(owners, requester: str) -> list[str]:
    """A reclaim order for the tests: the order owners registered in."""
    return [o.name for o in owners]


def make_pool(geo: Geometry, pages: int, reclaim_order=in_given_order) -> PagePool:
    return PagePool(
        geo.backend,
        geo.page_bytes,
        budget_bytes=(pages + 1) * geo.page_bytes,
        reclaim_order=reclaim_order,
    )


def make_cache(
    pool: PagePool,
    owner: str,
    geo: Geometry,
    *,
    layers=3,
    heads=3,
    block=4,
    max_pages=16,
    cached=1,
    dtype=torch.float32,
    prefix=False,
) -> PagedKV:
    layout = KVLayout(
        layers, block, heads, geo.head_dim, dtype, pool.page_bytes, pool.backend.granularity
    )
    return PagedKV(pool, owner, layout, max_pages, cached, prefix_caching=prefix)


def fill(view: torch.Tensor, blocks: list[int], values: list[float]) -> None:
    """view[b] = value for each (block, value), in one write."""
    idx = torch.tensor(blocks, device=view.device)
    val = torch.tensor(values, dtype=view.dtype, device=view.device)
    view[idx] = val.view(-1, 1, 1, 1, 1).expand(-1, *view.shape[1:])


def holds(view: torch.Tensor, blocks: list[int], values: list[float]) -> bool:
    """Whether every element of view[b] equals its value, for each (block, value)."""
    idx = torch.tensor(blocks, device=view.device)
    val = torch.tensor(values, dtype=view.dtype, device=view.device)
    return bool(torch.all(view[idx] == val.view(-1, 1, 1, 1, 1)))


def check(*caches: PagedKV) -> None:
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


def test_every_layer_and_block_has_its_own_memory(geo):
    pool = make_pool(geo, 8)
    kv = make_cache(pool, "m", geo, max_pages=8)
    n = kv.allocator.bpp * 3
    blocks = kv.allocator.allocate(n)
    assert blocks is not None and len(set(blocks)) == n
    assert {kv.layout.locate(b)[0] for b in blocks} == {1, 2, 3}  # page 0 is never handed out
    for l, view in enumerate(kv.layer_views):
        assert view.shape[1:] == (2, 4, 3, geo.head_dim)
        assert view.device.type == geo.backend.device.type
        fill(view, blocks, [l * 1000 + i for i in range(n)])
    for l, view in enumerate(kv.layer_views):
        assert holds(view, blocks, [l * 1000 + i for i in range(n)]), l
    kv.allocator.free(blocks)
    check(kv)
    kv.close()
    pool.check_integrity()


def test_best_fit_fills_partly_used_pages_and_unmaps_beyond_the_reserve(geo):
    pool = make_pool(geo, 8)
    kv = make_cache(pool, "m", geo, cached=1)
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


def test_data_survives_on_mapped_pages_and_page_zero_stays_mapped(geo):
    pool = make_pool(geo, 4)
    kv = make_cache(pool, "m", geo, cached=0)
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


def test_allocation_beyond_the_budget_takes_nothing(geo):
    pool = make_pool(geo, 3)
    kv = make_cache(pool, "m", geo)
    bpp = kv.allocator.bpp
    held = kv.allocator.allocate(2 * bpp)
    assert kv.allocator.can_allocate(bpp) and not kv.allocator.can_allocate(bpp + 1)
    assert kv.allocator.allocate(bpp + 1) is None
    assert kv.allocator.num_used_blocks == 2 * bpp and pool.pages_of("m") == 2
    check(kv)
    kv.allocator.free(held)
    check(kv)
    kv.close()


def test_burst_of_one_model_is_served_by_pages_another_gave_back(geo):
    pool = make_pool(geo, 10)
    a = make_cache(pool, "a", geo, max_pages=16, cached=8)
    b = make_cache(pool, "b", geo, max_pages=16, cached=8)
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


def test_random_alloc_free_keeps_accounting_exact(geo):
    rng = random.Random(0)
    pool = make_pool(geo, 12)
    caches = [
        make_cache(pool, f"m{i}", geo, max_pages=10, cached=rng.randint(0, 3)) for i in range(3)
    ]
    held: list[list[tuple[PagedKV, list[int]]]] = [[] for _ in caches]
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
                fill(kv.layer_views[-1], blocks, [float(b) for b in blocks])
                held[i].append(blocks)
        check(*caches)
    for i, kv in enumerate(caches):
        for blocks in held[i]:
            assert holds(kv.layer_views[-1], blocks, [float(b) for b in blocks])
            kv.allocator.free(blocks)
        check(kv)
        kv.close()
    pool.check_integrity()


def test_backend_handles_alias_survive_unmap_and_unmap_spans_mappings(geo):
    """The raw contract: a handle mapped at two places shows the same bytes; its data survives an
    unmap and a map elsewhere; map_many and one unmap over adjacent mappings round-trip."""
    be = geo.backend
    g = be.granularity
    a, b = be.reserve(4 * g), be.reserve(4 * g)
    h1, h2, h3 = be.create(g), be.create(g), be.create(g)
    be.map(a, 0, h1)
    be.map(b, g, h1)  # h1 at two places at once
    va, vb = be.view(a), be.view(b)
    assert va.device.type == vb.device.type == be.device.type
    assert va.numel() == 4 * g and va.data_ptr() == a.addr
    pattern = torch.arange(g, dtype=torch.int64, device=va.device).remainder(251).to(torch.uint8)
    va[:g] = pattern
    assert torch.equal(vb[g : 2 * g], pattern)
    be.unmap(a, 0, g)
    be.unmap(b, g, g)
    be.map_many(b, [(2 * g, h2), (0, h1), (g, h3)])  # out of order, adjacent
    vb[g : 2 * g] = 7
    vb[2 * g : 3 * g] = 9
    assert torch.equal(vb[:g], pattern)  # h1's bytes survived its unmaps
    be.unmap(b, 0, 3 * g)  # one call over three mappings
    be.map(a, 3 * g, h3)
    be.map(a, 0, h2)
    assert bool(torch.all(va[3 * g :] == 7)) and bool(torch.all(va[:g] == 9))
    be.unmap(a, 3 * g, g)
    be.unmap(a, 0, g)
    for h in (h1, h2, h3):
        be.release(h)
    be.free(a)
    be.free(b)


def test_the_pool_reclaims_in_the_order_it_is_given_and_not_without_one(geo):
    """The reclaim order comes from outside: with none, another owner's reserve is never taken;
    with one, pages come back from the owners it names, first to last."""
    for order, expect in ((None, None), (lambda owners, me: ["c", "a"], {"a": 1, "c": 0})):
        pool = make_pool(geo, 6, reclaim_order=order)
        a, b, c = (make_cache(pool, n, geo, max_pages=8, cached=3) for n in "abc")
        bpp = a.allocator.bpp
        for kv in (a, c):  # a and c each keep 3 cached pages after their burst
            kv.allocator.free(kv.allocator.allocate(3 * bpp))
        assert pool.num_available == 0 and pool.reclaimable(exclude="b") == (6 if order else 0)
        got = b.allocator.allocate(4 * bpp)
        if expect is None:
            assert got is None and pool.pages_of("a") == pool.pages_of("c") == 3
        else:  # c gives all 3 first, then a gives 1
            assert got is not None and pool.pages_of("b") == 4
            assert {n: pool.pages_of(n) for n in "ac"} == {"a": 2, "c": 0}
            assert pool.reclaimed_total == 4
            b.allocator.free(got)
        check(a, b, c)
        for kv in (a, b, c):
            kv.close()
        pool.check_integrity()
        assert pool.stats().owned == {}


def test_pages_held_for_a_model_go_to_it_alone(geo):
    """Free pages held for model x: another owner cannot take them (nor a page of its own
    reserve-less growth beyond what is left), x's owners can; the hold ends once x took them,
    or when released; a hold for another model replaces it."""
    pool = make_pool(geo, 4, reclaim_order=None)
    x, y = (make_cache(pool, n, geo, max_pages=8, cached=0) for n in "xy")
    bpp = x.allocator.bpp
    pool.hold_for("x", 3)
    pool.hold_for("x", 0)  # adds nothing, keeps the hold
    assert pool.held == ("x", 3) and pool.available_to("y") == 1 and pool.available_to("x/w") == 4
    assert y.allocator.allocate(2 * bpp) is None and pool.pages_of("y") == 0
    got_y = y.allocator.allocate(bpp)  # the page that is not held
    assert got_y is not None and pool.available_to("y") == 0
    got_x = x.allocator.allocate(2 * bpp)
    assert got_x is not None and pool.held == ("x", 1)
    x.allocator.free(got_x)  # unmapped (no reserve): free again, still held for x
    assert pool.available_to("y") == 2 and pool.held == ("x", 1)
    pool.hold_for("z", 2)  # another taker: x's hold is gone
    assert pool.held == ("z", 2) and pool.available_to("x") == 1
    pool.release_hold(keep="z")
    assert pool.held == ("z", 2)
    pool.release_hold()
    assert pool.held is None and pool.available_to("y") == 3
    y.allocator.free(got_y)
    check(x, y)
    for kv in (x, y):
        kv.close()
    pool.check_integrity()


def test_pooled_buffer_maps_exactly_what_it_accounts(geo):
    from kvpool import PooledBuffer

    pool = make_pool(geo, 4)
    stride = 2 * pool.page_bytes  # a gap between pages, never mapped
    buf = PooledBuffer(pool, "w", num_pages=6, page_stride=stride)
    buf.map_null(0)
    assert buf.map_pages([3, 1]) and buf.num_mapped_pages == 2 and pool.pages_of("w") == 2
    with pytest.raises(RuntimeError):
        buf.map_pages([1])  # already mapped
    with pytest.raises(RuntimeError):
        buf.map_pages([6])  # out of range
    assert not buf.map_pages([2, 4, 5])  # only 2 pages left: nothing taken
    assert buf.num_mapped_pages == 2 and pool.num_available == 2
    view = buf.view()
    view[stride : stride + 8] = 5
    view[3 * stride : 3 * stride + 8] = 6
    buf.check_integrity(expected=[1, 3])
    buf.unmap_pages([1])
    with pytest.raises(RuntimeError):
        buf.unmap_pages([1])
    assert pool.pages_of("w") == 1 and buf.mapped_pages() == [3]
    assert bool(torch.all(view[3 * stride : 3 * stride + 8] == 6))
    buf.check_integrity(expected=[3])
    buf.close()
    pool.check_integrity()
    assert pool.stats().owned == {} and pool.num_available == 4
