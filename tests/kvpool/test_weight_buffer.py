"""Weights in the pool: a packed layout, a buffer whose pages come from the same pool as the KV
caches, a host copy of the same layout; eviction unmaps, activation maps and copies back."""

from __future__ import annotations

import pytest
import torch

from kvpool import (
    CpuBackend,
    HostBudget,
    HostCopy,
    PagedKV,
    PagePool,
    WeightBuffer,
    WeightLayout,
    map_and_load,
)
from kvpool.kv_layout import KVLayout
from kvpool.weight_buffer import ALIGN

PAGE = 64 << 10


def pool(pages: int) -> PagePool:
    return PagePool(
        CpuBackend(),
        PAGE,
        (pages + 1) * PAGE,
        reclaim_order=lambda owners, me: [o.name for o in owners],
    )


SPECS = [
    ("embed", (300, 16), torch.float32),  # 19,200 bytes
    ("norm", (16,), torch.float32),
    ("proj", (300, 33), torch.bfloat16),
    ("bias", (7,), torch.float16),
]


def test_the_layout_packs_aligned_slots_back_to_back():
    lay = WeightLayout.pack(SPECS)
    ends = 0
    for s, (name, shape, dtype) in zip(lay.slots, SPECS):
        assert (s.name, s.shape, s.dtype) == (name, shape, dtype)
        assert s.offset % ALIGN == 0 and s.offset >= ends and s.offset - ends < ALIGN
        ends = s.offset + s.nbytes
    assert lay.nbytes == ends and lay.num_pages(PAGE) == 1
    assert lay.num_pages(4096) == -(-ends // 4096)


def test_evict_and_activate_keep_addresses_and_bytes():
    p = pool(6)
    lay = WeightLayout.pack([("a", (40_000,), torch.float32), ("b", (10, 10), torch.bfloat16)])
    wb = WeightBuffer(p, "m/weights", lay)
    assert wb.num_pages == 3 and not wb.mapped
    assert wb.map() and wb.mapped and p.pages_of("m/weights") == 3
    views = wb.views()
    views["a"].copy_(torch.arange(40_000, dtype=torch.float32))
    views["b"].fill_(1.5)
    host = HostCopy(wb.nbytes, torch.device("cpu"))
    host.save(wb.bytes())
    addr = views["a"].data_ptr()
    wb.unmap()  # evicted: the pages are the pool's again
    assert not wb.mapped and p.pages_of("m/weights") == 0 and p.num_available == 6
    wb.check_integrity()
    other = WeightBuffer(p, "x/weights", lay)  # another model takes those very pages
    assert other.map()
    other.bytes().fill_(7)
    other.unmap()
    other.close()
    assert wb.map()  # activated: map + one copy
    host.load(wb.bytes())
    assert views["a"].data_ptr() == addr  # the same addresses: views and graphs stay valid
    assert torch.equal(views["a"], torch.arange(40_000, dtype=torch.float32))
    assert bool(torch.all(views["b"] == 1.5))
    stats = p.stats()
    assert stats.owned_by_kind == {"weights": 3}
    wb.check_integrity()
    wb.close()
    host.close()
    p.check_integrity()
    assert p.stats().owned == {}


def test_weights_and_kv_share_one_pool_and_are_counted_apart():
    p = pool(8)
    wb = WeightBuffer(p, "m/weights", WeightLayout.pack([("w", (5 * PAGE // 4,), torch.float32)]))
    layout = KVLayout(2, 4, 1, 16, torch.float32, PAGE, p.backend.granularity)
    kv = PagedKV(p, "m", layout, max_pages=9, max_cached_pages=8)
    assert wb.map()  # 5 pages
    assert kv.allocator.allocate(4 * layout.blocks_per_page) is None  # 3 left, none reclaimable
    blocks = kv.allocator.allocate(3 * layout.blocks_per_page)
    assert blocks is not None
    assert p.stats().owned_by_kind == {"weights": 5, "kv": 3} and p.num_available == 0
    assert not wb.can_map() or wb.mapped
    kv.allocator.free(blocks)  # cached, reclaimable by another owner
    wb.unmap()
    other = WeightBuffer(
        p, "o/weights", WeightLayout.pack([("w", (8 * PAGE // 4,), torch.float32)])
    )
    assert other.can_map() and other.map()  # 5 free + the 3 cached KV pages taken back
    assert p.pages_of("m") == 0
    kv.check_integrity()
    for b in (other, wb):
        b.check_integrity()
        b.close()
    kv.close()
    p.check_integrity()
    assert p.stats().owned == {}


def test_a_buffer_that_cannot_be_backed_maps_nothing():
    p = pool(2)
    wb = WeightBuffer(p, "big/weights", WeightLayout.pack([("w", (3 * PAGE,), torch.uint8)]))
    assert not wb.can_map() and not wb.map()
    assert p.pages_of("big/weights") == 0 and p.num_available == 2
    wb.check_integrity()
    wb.close()
    p.check_integrity()


def test_map_and_load_maps_then_copies_or_leaves_nothing_mapped():
    p = pool(4)
    lay = WeightLayout.pack([("w", (3 * PAGE // 4,), torch.float32)])
    src = WeightBuffer(p, "src/weights", lay)
    assert src.map()
    src.views()["w"].copy_(torch.arange(3 * PAGE // 4, dtype=torch.float32))
    host = HostCopy(src.nbytes, torch.device("cpu"))
    host.save(src.bytes())
    wb = WeightBuffer(p, "m/weights", lay)
    assert map_and_load(wb, host) is None  # 1 page free of the 3: nothing taken
    assert p.pages_of("m/weights") == 0 and not wb.mapped
    src.unmap()

    class Broken:
        def load_async(self, dst):
            raise RuntimeError("the copy could not start")

    with pytest.raises(RuntimeError, match="could not start"):
        map_and_load(wb, Broken())
    assert p.pages_of("m/weights") == 0 and p.num_available == 4  # its pages given back
    transfer = map_and_load(wb, host)
    assert transfer is not None and wb.mapped
    transfer.wait()
    assert torch.equal(wb.views()["w"], torch.arange(3 * PAGE // 4, dtype=torch.float32))
    for b in (wb, src):
        b.check_integrity()
        b.close()
    host.close()
    p.check_integrity()
    assert p.stats().owned == {}


def test_a_host_copy_written_through_the_layout_loads_as_the_tensors():
    """A host copy filled through the layout's views (no device buffer mapped to make it) lands
    in the buffer as each tensor; a buffer too small for the layout is refused."""
    p = pool(4)
    lay = WeightLayout.pack((n, s, d) for n, s, d in SPECS)
    tensors = {n: torch.randn(s).to(d) for n, s, d in SPECS}
    host = HostCopy(lay.nbytes, torch.device("cpu"))
    for name, view in lay.views(host.data).items():
        view.copy_(tensors[name])
    wb = WeightBuffer(p, "m/weights", lay)
    assert p.pages_of("m/weights") == 0  # nothing mapped until now
    map_and_load(wb, host).wait()
    for name, t in wb.views().items():
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name]), name
    with pytest.raises(ValueError, match="over 16 torch.uint8"):
        lay.views(torch.zeros(16, dtype=torch.uint8))
    wb.check_integrity()
    wb.close()
    host.close()
    p.check_integrity()
    assert p.stats().owned == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_activation_copies_on_a_side_stream():
    from kvpool import CudaBackend

    page = 2 << 20
    p = PagePool(CudaBackend("cuda"), page, 9 * page, precreate=8)
    lay = WeightLayout.pack([("w", (3 * page // 4,), torch.bfloat16)])  # 1.5 pages: 2
    wb = WeightBuffer(p, "m/weights", lay)
    assert wb.map()
    w = wb.views()["w"]
    w.copy_(torch.randn(w.shape, device="cuda").to(torch.bfloat16))
    ref = w.clone()
    host = HostCopy(wb.nbytes, torch.device("cuda"))
    assert host.pinned
    host.save(wb.bytes())
    wb.unmap()
    assert wb.map()
    host.load(wb.bytes(), chunk_bytes=1 << 20)
    assert torch.equal(w, ref)  # the compute stream waited for the copy stream
    wb.unmap()
    wb.close()
    host.close()
    p.check_integrity()
    p.close()


def test_a_split_copy_that_fails_is_waited_for_whole_before_its_pages_may_go():
    """One shard's copy fails (its destination is too small): the wait raises only once the
    other shard's copy has landed too, and a copy that cannot start (a destination missing)
    waits for those started; the pages are then unmapped with nothing writing them."""
    from kvpool.sharded_weights import ShardedHostCopy

    p = pool(24)
    big = WeightLayout.pack([("w", (1 << 18,), torch.float32)])  # 1 MiB: 16 pages
    small = WeightLayout.pack([("w", (16,), torch.float32)])
    bufs = [WeightBuffer(p, "m/0", big), WeightBuffer(p, "m/1", small)]
    assert all(b.map() for b in bufs)
    hosts = [HostCopy(big.nbytes, torch.device("cpu")) for _ in range(2)]
    for h in hosts:
        h.data.copy_(torch.randint(0, 255, (h.nbytes,), dtype=torch.uint8))
    copy = ShardedHostCopy(hosts)
    transfer = copy.load_async([bufs[0].bytes(), bufs[1].bytes()])
    with pytest.raises(RuntimeError):
        transfer.wait()
    assert all(t.done() for t in transfer.parts)
    assert torch.equal(bufs[0].bytes(), hosts[0].data)
    bufs[0].bytes().zero_()
    with pytest.raises(ValueError):  # one destination for two shards
        copy.load_async([bufs[0].bytes()])
    assert torch.equal(bufs[0].bytes(), hosts[0].data)  # the started copy had landed
    for b in bufs:
        b.unmap()
        b.check_integrity()
        b.close()
    p.check_integrity()


def test_the_host_budget_counts_copies_and_refuses_past_it():
    budget = HostBudget(100 << 20, used=60 << 20)
    budget.take(30 << 20, "adapter a")
    with pytest.raises(MemoryError, match=r"adapter b \(20.0 MiB\) does not fit.*0.09 of 0.10"):
        budget.take(20 << 20, "adapter b")
    assert budget.used == 90 << 20  # nothing taken by the refusal
    budget.give(30 << 20)
    budget.take(20 << 20, "adapter b")
    budget.give(20 << 20)
    assert budget.used == 60 << 20  # every byte given back
