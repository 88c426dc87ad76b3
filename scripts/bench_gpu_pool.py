"""GPU page-pool benchmark: grow then shrink one model's KV cache by 10 GiB (DESIGN.md §3, §7).

Side by side, in one run, on the same device:
- through the pool: PooledBuffer.map_pages / unmap_pages of a Llama-3.1-8B-shaped KV cache (pool
  accounting, the virtual buffer, the CUDA backend), 64 MiB pages (the default) and 256 MiB pages;
- raw driver calls on the same 64 MiB handles: cuMemMap + cuMemSetAccess per handle and
  cuMemUnmap per handle; and batched (one cuMemSetAccess / one cuMemUnmap over the whole range);
- the 2 MiB-per-layer alternative: the same 10 GiB as 2 MiB handles, one call of each per handle;
- end to end through the block allocator: allocate every block of 10 GiB, then free them.
Target: <= 5 ms each way. Every figure is the median of --repeats runs (ms).

    python3 scripts/bench_gpu_pool.py [--gib 10] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool import CudaBackend, KVLayout, PagedKV, PagePool  # noqa: E402

MiB = 1 << 20


def median_ms(fn, repeats: int, between=None) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        if between:
            between()
    return statistics.median(times)


def llama_layout(page_bytes: int, granularity: int) -> KVLayout:
    return KVLayout(32, 16, 8, 128, torch.bfloat16, page_bytes, granularity)


def through_pool(be: CudaBackend, total: int, page_bytes: int, repeats: int) -> dict:
    n = total // page_bytes
    pool = PagePool(be, page_bytes, (n + 1) * page_bytes, precreate=n)
    kv = PagedKV(pool, "bench", llama_layout(page_bytes, be.granularity), n + 1, 0)
    mapper = kv.cache.pages
    pages = list(range(1, n + 1))
    grow, shrink = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        assert mapper.map_pages(pages)
        grow.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        mapper.unmap_pages(pages)
        shrink.append((time.perf_counter() - t) * 1e3)
    # the mapped memory is real: touch the first byte of every page
    assert mapper.map_pages(pages)
    flat = mapper.view()
    idx = torch.tensor([p * kv.layout.page_stride_bytes for p in pages], device=be.device)
    flat[idx] = 7
    assert int(flat[idx].sum()) == 7 * n
    mapper.unmap_pages(pages)
    # end to end: the block allocator maps every page it needs, then gives them all back
    bpp = kv.allocator.bpp
    alloc, free = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        blocks = kv.allocator.allocate(n * bpp)
        alloc.append((time.perf_counter() - t) * 1e3)
        assert blocks is not None and kv.allocator.num_mapped_pages == n
        t = time.perf_counter()
        kv.allocator.free(blocks)
        free.append((time.perf_counter() - t) * 1e3)
    kv.check_integrity()
    kv.close()
    pool.close()
    med = statistics.median
    return {
        "handles": n,
        "grow_ms": med(grow),
        "shrink_ms": med(shrink),
        "alloc_blocks_ms": med(alloc),
        "free_blocks_ms": med(free),
    }


def raw(be: CudaBackend, total: int, handle_bytes: int, repeats: int, batched: bool) -> dict:
    cu = be.cu
    n = total // handle_bytes
    handles = [be.create(handle_bytes).raw for _ in range(n)]
    res = be.reserve(total)
    access = be._access
    ok = cu.CUresult.CUDA_SUCCESS

    def check(r):
        if r[0] != ok:
            raise RuntimeError(r[0])

    def grow():
        for i, h in enumerate(handles):
            check(cu.cuMemMap(res.addr + i * handle_bytes, handle_bytes, 0, h, 0))
            if not batched:
                check(cu.cuMemSetAccess(res.addr + i * handle_bytes, handle_bytes, access, 1))
        if batched:
            check(cu.cuMemSetAccess(res.addr, total, access, 1))

    def shrink():
        if batched:
            check(cu.cuMemUnmap(res.addr, total))
            return
        for i in range(n):
            check(cu.cuMemUnmap(res.addr + i * handle_bytes, handle_bytes))

    g, s = [], []
    for _ in range(repeats):
        g.append(median_ms(grow, 1))
        s.append(median_ms(shrink, 1))
    for h in handles:
        check(cu.cuMemRelease(h))
    be.free(res)
    return {"handles": n, "grow_ms": statistics.median(g), "shrink_ms": statistics.median(s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    total, r = args.gib << 30, args.repeats
    be = CudaBackend("cuda")
    torch.cuda.synchronize()
    out = {
        "device": torch.cuda.get_device_name(),
        "gib": args.gib,
        "granularity": be.granularity,
        "pool_64m": through_pool(be, total, 64 * MiB, r),
        "pool_128m": through_pool(be, total, 128 * MiB, r),
        "pool_256m": through_pool(be, total, 256 * MiB, r),
        "raw_64m": raw(be, total, 64 * MiB, r, batched=False),
        "raw_128m": raw(be, total, 128 * MiB, r, batched=False),
        "raw_64m_batched": raw(be, total, 64 * MiB, r, batched=True),
        "raw_2m": raw(be, total, 2 * MiB, max(3, r // 2), batched=False),
    }
    print(f"# grow / shrink {args.gib} GiB of KV, {out['device']}, median of {r} (ms)")
    print(f"{'path':<44} {'handles':>7} {'grow':>8} {'shrink':>8}")
    rows = [
        ("pool: PooledBuffer.map/unmap_pages, 64 MiB pages", out["pool_64m"]),
        ("pool: PooledBuffer.map/unmap_pages, 128 MiB pages", out["pool_128m"]),
        ("pool: PooledBuffer.map/unmap_pages, 256 MiB pages", out["pool_256m"]),
        ("raw driver, same 64 MiB handles, per handle", out["raw_64m"]),
        ("raw driver, same 128 MiB handles, per handle", out["raw_128m"]),
        ("raw driver, 64 MiB handles, batched", out["raw_64m_batched"]),
        ("raw driver, 2 MiB-per-layer handles", out["raw_2m"]),
    ]
    for name, d in rows:
        print(f"{name:<44} {d['handles']:>7} {d['grow_ms']:>8.2f} {d['shrink_ms']:>8.2f}")
    p = out["pool_64m"]
    print(
        f"{'allocator: allocate / free all blocks, 64 MiB':<44} {p['handles']:>7} "
        f"{p['alloc_blocks_ms']:>8.2f} {p['free_blocks_ms']:>8.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
