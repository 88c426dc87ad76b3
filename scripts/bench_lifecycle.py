"""The lifecycle benchmark: what moving memory and models costs on the GPU, each figure beside
its reference (a raw driver call, the link's copy rate, the same step without the move) measured
in the same run. One command a part:

    python3 scripts/bench_lifecycle.py pool [--gib 10] [--repeats 7]       # grow/shrink KV
    python3 scripts/bench_lifecycle.py models [--only activation,switching] # activation, swaps
    python3 scripts/bench_lifecycle.py multi [--preset llama-3.1-8b]        # several GPUs
    python3 scripts/bench_lifecycle.py tp [--preset llama-3.1-70b --tp 2]  # a split model
    python3 scripts/bench_lifecycle.py arbitrator                          # under pressure

Each part's --help says what it measures; each takes --json OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpool import (  # noqa: E402
    CudaBackend,
    HostCopy,
    KVLayout,
    PagedKV,
    PagePool,
)
from models.attention.base import (  # noqa: E402
    AttentionMetadata,
    ForwardContext,
    SeqChunk,
    layer_specs,
)
from models.attention.torch_paged import TorchPagedAttention  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.loader import init_dummy_weights  # noqa: E402
from models.presets import get_preset  # noqa: E402
from models.registry import get_model_class  # noqa: E402
from models.tensor_parallel import TensorParallel, default_all_reduce, shard_config  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine.commands import PlanEvict  # noqa: E402
from prism_server.engine.engine import Engine  # noqa: E402
from prism_server.engine.memory_budget import weight_pool_bytes  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

# --- pool --------------------------------------------------------------------------------------

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


def main_pool() -> None:
    """GPU page-pool benchmark: grow then shrink one model's KV cache by 10 GiB (DESIGN.md §3, §7).

    Side by side, in one run, on the same device:
    - through the pool: PooledBuffer.map_pages / unmap_pages of a Llama-3.1-8B-shaped KV cache (pool
      accounting, the virtual buffer, the CUDA backend), 64 MiB pages (the default)
      and 256 MiB pages;
    - raw driver calls on the same 64 MiB handles: cuMemMap + cuMemSetAccess per handle and
      cuMemUnmap per handle; and batched (one cuMemSetAccess / one cuMemUnmap over the whole range);
    - the 2 MiB-per-layer alternative: the same 10 GiB as 2 MiB handles, one call of each per
      handle;
    - end to end through the block allocator: allocate every block of 10 GiB, then free them.
    Target: <= 5 ms each way. Every figure is the median of --repeats runs (ms).

        python3 scripts/bench_lifecycle.py pool [--gib 10] [--repeats 7] [--json out.json]
    """
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


# --- models ------------------------------------------------------------------------------------

GiB = 1 << 30
PRESETS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-14b")


def h2d_gbs(nbytes: int = 8 * GiB) -> float:
    """Pinned host -> device, chunked on a side stream: the ceiling activation is compared to."""
    host = HostCopy(nbytes, torch.device("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.load(dst)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        host.load(dst)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    host.close()
    return nbytes / min(times) / 1e9


def spec(name: str, preset: str) -> ModelSpec:
    return ModelSpec(name, f"dummy:{preset}", max_model_len=4096, max_num_seqs=16)


def activation(preset: str, bw: float, repeats: int = 5) -> dict:
    s = spec("m", preset)
    with Engine(EngineConfig(models=(s,), device="cuda", kv_budget_bytes=4 * GiB)) as e:
        nbytes = e.model_snapshot("m").weight_bytes
        seconds = []
        for _ in range(repeats):
            e.evict("m")
            seconds.append(e.activate("m"))
        e.check_integrity()
    best, med = min(seconds), statistics.median(seconds)
    floor = nbytes / (bw * 1e9)
    print(
        f"{preset}: {nbytes / GiB:.2f} GiB, activate median {med * 1e3:.0f} ms (best "
        f"{best * 1e3:.0f}), floor {floor * 1e3:.0f} ms at {bw:.1f} GB/s -> {floor / med:.0%}",
        flush=True,
    )
    return {"bytes": nbytes, "median_s": med, "best_s": best, "floor_s": floor}


def switching_ttft(switches: int) -> dict:
    """A and B (8B each) share a pool that holds one of them plus KV: every request finds its
    model offloaded, evicts the other and activates its own. TTFT from arrival."""
    a, b = spec("a", "llama-3.1-8b"), spec("b", "llama-3.1-8b")
    w = weight_pool_bytes(a, torch.device("cuda"), 128 << 20)
    cfg = EngineConfig(models=(a, b), device="cuda", pool_budget_bytes=w + 6 * GiB)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, 120000, (1024,), generator=g).tolist()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Engine(cfg) as e:
        for n in ("a", "b"):  # warm-up: both have run once
            e.generate(n, [prompt], params)
        ttfts = []
        for i in range(switches):
            name = "ab"[i % 2]
            q: queue.SimpleQueue = queue.SimpleQueue()
            t0 = time.perf_counter()
            first: list[float] = []

            def sink(out, first=first, q=q):
                if out.new_token_ids and not first:
                    first.append(time.perf_counter())
                if out.finished:
                    q.put(out)

            e.add_request(name, prompt, params, sink)
            out = q.get(timeout=120)
            assert out.error is None, out.error
            ttfts.append(first[0] - t0)
        snap = {m.name: m for m in e.worker.snapshot_now().models}
        e.check_integrity()
    ttfts.sort()
    p50 = statistics.median(ttfts)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    acts = snap["a"].activations + snap["b"].activations
    print(
        f"switching 8B, 1k prompt: TTFT p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms "
        f"over {switches} switches ({acts} activations)",
        flush=True,
    )
    return {"p50_s": p50, "p99_s": p99, "switches": switches, "activations": acts}


def evict_to_kv(repeats: int = 5) -> dict:
    """From "evict A (8B)" to "B holds A's freed pages as KV blocks": both on the engine thread,
    timed there (the unmap of A's weights + the map of as many KV pages for B)."""
    a, b = spec("a", "llama-3.1-8b"), spec("b", "llama-3.2-1b")
    page = 128 << 20
    wa = weight_pool_bytes(a, torch.device("cuda"), page)
    wb = weight_pool_bytes(b, torch.device("cuda"), page)
    cfg = EngineConfig(models=(a, b), device="cuda", pool_budget_bytes=wa + wb + 2 * page)
    with Engine(cfg) as e:
        w = e.worker
        mb = w.models["b"]
        n_pages = wa // page
        blocks_per_page = mb.kv.layout.blocks_per_page
        times = []
        for _ in range(repeats):

            def move():
                t = time.perf_counter()
                w.models["a"].evict()
                got = mb.kv.allocator.allocate(n_pages * blocks_per_page)
                took = time.perf_counter() - t
                assert got is not None, "B could not take A's pages"
                mb.kv.allocator.free(got)
                mb.kv.allocator.release_all()
                assert w.memory.make_resident(w.models["a"], time.monotonic(), wait=True)
                return took

            times.append(w.call(move))
        e.check_integrity()
    med = statistics.median(times)
    print(
        f"evict 8B -> its {n_pages} pages ({wa / GiB:.1f} GiB) mapped as B's KV: median "
        f"{med * 1e3:.1f} ms",
        flush=True,
    )
    return {"median_s": med, "pages": n_pages, "bytes": wa}


def tpot_during_activation(rounds: int = 6, batch: int = 16) -> dict:
    """R (8B) decodes a batch of `batch` while X (8B, both fit) is evicted and activated again
    and again: R's inter-token times inside X's activations against those between them."""
    r, x = spec("r", "llama-3.1-8b"), spec("x", "llama-3.1-8b")
    w = weight_pool_bytes(r, torch.device("cuda"), 128 << 20)
    cfg = EngineConfig(models=(r, x), device="cuda", pool_budget_bytes=2 * w + 8 * GiB)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(300, 120000, (128,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    with Engine(cfg) as e:
        e.generate("r", prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        stamps: list[float] = []
        reqs = []
        for i, p in enumerate(prompts):

            def sink(out, i=i):
                if i == 0 and out.new_token_ids:
                    stamps.append(time.perf_counter())

            reqs.append(e.add_request("r", p, params, sink))
        while len(stamps) < 50:  # all admitted and decoding
            time.sleep(0.01)
        windows, took = [], []
        for _ in range(rounds):
            time.sleep(0.4)  # quiet
            e.evict("x")
            t0 = time.perf_counter()
            took.append(e.activate("x"))
            windows.append((t0, time.perf_counter()))
        time.sleep(0.4)
        end = time.perf_counter()
        for q in reqs:
            e.abort("r", q.request_id)
        e.worker.snapshot_now()
        e.check_integrity()
    during, quiet = [], []
    start = windows[0][0] - 0.4
    for a, b in zip(stamps, stamps[1:]):
        if a < start or b > end:
            continue
        inside = any(a < w1 and b > w0 for w0, w1 in windows)
        (during if inside else quiet).append(b - a)
    d, q = statistics.mean(during), statistics.mean(quiet)
    print(
        f"8B decode B={batch} while another 8B activates ({statistics.median(took) * 1e3:.0f} ms "
        f"each, {rounds}x): TPOT {d * 1e3:.2f} ms vs {q * 1e3:.2f} ms between activations "
        f"({d / q - 1:+.1%}; {len(during)} / {len(quiet)} steps)",
        flush=True,
    )
    return {"tpot_during_s": d, "tpot_quiet_s": q, "activation_s": statistics.median(took)}


def startup(n_models: int = 8, fit: int = 4) -> dict:
    """Start-up time of an engine with n_models 1B models, `fit` of them resident at once,
    against one such model loaded alone (x n_models)."""
    page = 128 << 20
    specs = tuple(
        ModelSpec(f"m{i}", "dummy:llama-3.2-1b", seed=i, max_model_len=4096)
        for i in range(n_models)
    )
    w = weight_pool_bytes(specs[0], torch.device("cuda"), page)
    t = time.perf_counter()
    with Engine(EngineConfig(models=specs[:1], device="cuda", kv_budget_bytes=4 * GiB)):
        one = time.perf_counter() - t
    cfg = EngineConfig(models=specs, device="cuda", pool_budget_bytes=fit * w + 4 * GiB)
    t = time.perf_counter()
    with Engine(cfg) as e:
        took = time.perf_counter() - t
        snap = e.worker.snapshot_now()
        resident = sum(m.residency.value == "resident" for m in snap.models)
        overhead = [m.overhead_bytes for m in snap.models]
    print(
        f"start-up, {n_models} x llama-3.2-1b ({resident} resident): {took:.1f} s, against one "
        f"alone {one:.1f} s (x{n_models} = {one * n_models:.1f} s); per-model memory outside "
        f"the pool: first {overhead[0] / 2**20:.0f} MiB, then median "
        f"{statistics.median(overhead[1:]) / 2**20:.0f} MiB",
        flush=True,
    )
    return {"seconds": took, "one_model_s": one, "resident": resident, "overhead": overhead}


SECTIONS = ("activation", "switching", "evict_to_kv", "tpot_during_activation", "startup")


def main_models() -> None:
    """Model lifecycle on the GPU: activation from the pinned host copy against the H2D bandwidth
    measured in the same run; time to first token for requests that each find their model
    offloaded (two 8B models that cannot both be resident, alternating); evict -> the pages as
    another model's KV; a resident model's TPOT while another activates, against without; start-up
    time of eight models.

        python3 scripts/bench_lifecycle.py models [--json out.json] [--switches 20] [--only a,b]
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--switches", type=int, default=20)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        ap.error(f"unknown sections {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")
    out: dict = {"device": torch.cuda.get_device_name()}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))

    if "activation" in only:
        out["h2d_gbs"] = bw = h2d_gbs()
        print(f"pinned H2D, chunked on a copy stream: {bw:.1f} GB/s", flush=True)
        for p in PRESETS:
            out[p] = activation(p, bw)
            save()
    if "switching" in only:
        out["switching"] = switching_ttft(args.switches)
    if "evict_to_kv" in only:
        out["evict_to_kv"] = evict_to_kv()
    if "tpot_during_activation" in only:
        out["tpot_during_activation"] = tpot_during_activation()
    if "startup" in only:
        out["startup"] = startup()
    save()


# --- multi -------------------------------------------------------------------------------------


def activate_all(e: Engine, names: list[str]) -> float:
    """Seconds until every model in `names` (offloaded) is resident, activated at once."""
    errors: list[BaseException] = []

    def one(n: str) -> None:
        try:
            e.activate(n)
        except BaseException as x:  # noqa: BLE001 (reported below)
            errors.append(x)

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - t
    if errors:
        raise errors[0]
    return took


def main_multi() -> None:
    """Several GPUs in one process: activation when every GPU loads weights at once, against one GPU
    alone, and a model's move to another GPU, against its activation in place (same run).

    One 8B-shaped dummy model per GPU (devices = every GPU the machine has). Each is evicted, then
    activated: first on GPU 0 alone, then on every GPU at once (one thread each; every GPU has its
    own engine thread and copy stream). Aggregate GB/s against the single-GPU figure shows whether
    the host links load in parallel. Then GPU 0's model is moved to GPU 1 (`Engine.migrate`: built
    there from its host copy) and its first request timed, beside an activation in place.

        python3 scripts/bench_lifecycle.py multi [--preset llama-3.1-8b] [--repeats 3]
        python3 scripts/bench_lifecycle.py multi --cpu 2 --preset tiny-llama  # the logic only
    """
    ap = argparse.ArgumentParser(description=main_multi.__doc__)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument(
        "--cpu", type=int, metavar="N", help="N emulated CPU devices (a check of this script)"
    )
    args = ap.parse_args()
    n = args.cpu or torch.cuda.device_count()
    if n < 2:
        sys.exit(f"this benchmark needs two GPUs or more; this machine has {n}")
    names = [f"m{i}" for i in range(n)]
    specs = tuple(
        ModelSpec(m, f"dummy:{args.preset}", max_model_len=4096, max_num_seqs=16) for m in names
    )
    cfg = EngineConfig(
        models=specs,
        device="cpu" if args.cpu else "cuda",
        devices=n,
        page_bytes=(64 << 10) if args.cpu else 128 << 20,
        kv_budget_bytes=(1 << 20) if args.cpu else 8 * GiB,
        enable_prefix_caching=False,
        plan_interval_s=3600.0,  # no plan moves models while they are measured
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with Engine(cfg) as e:
        where = {m: e.served[m].device for m in names}
        nbytes = e.model_snapshot(names[0]).weight_bytes
        one, every = [], []
        for _ in range(args.repeats):
            for m in names:
                e.evict(m)
            one.append(activate_all(e, names[:1]))
            e.evict(names[0])
            every.append(activate_all(e, names))
        first = names[0]
        other = next(w.name for w in e.workers if w.name != where[first])
        moved = []
        for _ in range(args.repeats):
            w = next(w for w in e.workers if w.name == e.served[first].device)
            e.generate(first, [[5, 6, 7]], params)
            assert w.execute(PlanEvict(first))
            target = other if e.served[first].device == where[first] else where[first]
            t = time.perf_counter()
            ok = e.migrate(first, target)
            moved.append(time.perf_counter() - t)
            assert ok, "the move was refused"
        e.check_integrity()
    single, together = statistics.median(one), statistics.median(every)
    out = {
        "gpus": n,
        "preset": args.preset,
        "weight_bytes": nbytes,
        "devices": where,
        "one_gpu_s": single,
        "every_gpu_s": together,
        "one_gpu_gbs": nbytes / single / 1e9,
        "aggregate_gbs": n * nbytes / together / 1e9,
        "move_s": statistics.median(moved),
    }
    print(
        f"{n} devices, {args.preset} ({nbytes / GiB:.1f} GiB): activation on one device "
        f"{single * 1e3:.0f} ms ({out['one_gpu_gbs']:.1f} GB/s); on all {n} at once "
        f"{together * 1e3:.0f} ms ({out['aggregate_gbs']:.1f} GB/s aggregate, "
        f"x{out['aggregate_gbs'] / out['one_gpu_gbs']:.2f}); a move to another device "
        f"{out['move_s'] * 1e3:.0f} ms against an activation in place {single * 1e3:.0f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


# --- tp ----------------------------------------------------------------------------------------

BLOCK = 16


def build_shards(cfg: ModelConfig, devices: list[torch.device], dtype) -> list:
    scfg = shard_config(cfg, len(devices))
    shards = []
    for rank, dev in enumerate(devices):
        with torch.device("meta"):
            m = get_model_class(cfg.hf_architecture)(scfg)
        m = m.to_empty(device=dev).to(dtype).eval().requires_grad_(False)
        init_dummy_weights(m, seed=rank)
        shards.append(m)
    return shards


def backend(model, dtype, dev):
    """The shard's attention factory, made once: (caches, metadata) -> the step's attention."""
    if dev.type != "cuda":
        return TorchPagedAttention
    from models.attention.flashinfer_paged import AttentionShape, FlashInferBackend

    c = model.config
    shape = AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, BLOCK, dtype, dtype)
    return FlashInferBackend(shape, layer_specs(model), dev)


def sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@torch.no_grad()
def step_time(tp: TensorParallel, backends, caches, chunks: list[SeqChunk], repeats: int) -> float:
    """Median seconds of one step of `chunks` (each shard's metadata and attention built per
    step, as an engine step would)."""
    n = sum(c.num_new for c in chunks)
    times = []
    for _ in range(repeats + 2):
        sync(tp.devices)
        t = time.perf_counter()
        ctxs, ids, pos = [], [], []
        for b, d, c in zip(backends, tp.devices, caches):
            md = AttentionMetadata.build(chunks, BLOCK, d)
            with torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext():
                ctxs.append(ForwardContext(attn=b(c, md)))  # planned on its device's stream
            ids.append(torch.full((n,), 7, dtype=torch.long, device=d))
            pos.append(
                torch.cat(
                    [torch.arange(c.num_computed, c.num_computed + c.num_new) for c in chunks]
                ).to(d)
            )
        hidden = tp(ids, pos, ctxs)[0]
        tp.compute_logits(hidden[-1:])
        sync(tp.devices)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def copy_rate(dev: torch.device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write) on one GPU."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(dev)
    return 2 * src.numel() * 5 / (time.perf_counter() - t)


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tp_activation(preset: str, devices: list[torch.device], repeats: int) -> dict:
    """Seconds to activate the split model through the engine, and one shard's copy alone."""
    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.engine import Engine

    cuda = devices[0].type == "cuda"
    spec = ModelSpec("big", f"dummy:{preset}", max_model_len=4096, tensor_parallel=len(devices))
    cfg = EngineConfig(
        models=(spec,),
        device="cuda" if cuda else "cpu",
        devices=len(devices),
        kv_budget_bytes=4 << 30 if cuda else None,
        # the host copies of a 70B model (141 GB) exceed the default half of a 256 GiB host
        host_budget_bytes=int(0.75 * _host_ram()) if cuda else None,
        plan_interval_s=3600.0,
    )
    with Engine(cfg) as e:
        worker = e.worker.models["big"]
        times = []
        for _ in range(repeats):
            e.evict("big")
            times.append(e.activate("big"))
        shard = worker.weights.parts[0]
        host = worker.host.parts[0]
        one = []
        for _ in range(repeats):  # shard 0's copy alone (the model resident: its pages mapped)
            t = time.perf_counter()
            host.load(shard.bytes())
            one.append(time.perf_counter() - t)
        nbytes, shard_bytes = worker.weights.nbytes, shard.nbytes
        e.check_integrity()
    t_all, t_one = statistics.median(times), statistics.median(one)
    return {
        "activation_s": t_all,
        "weight_bytes": nbytes,
        "aggregate_gbs": nbytes / t_all / 1e9,
        "one_shard_alone_s": t_one,
        "one_link_gbs": shard_bytes / t_one / 1e9,
    }


def main_tp() -> None:
    """A model too large for one GPU, split over several (tensor parallelism in one process): its
    decode step and prefill time, beside the same shards with the all-reduce skipped (what the
    reduce costs) and the floor (each GPU reads its shard's weights once per step, all at once).
    Then its activation through the engine (devices = tp, tensor_parallel = tp: evicted, then
    activated, every shard's host copy at once over its own GPU's link), beside one shard's copy
    alone (what one link gives).

    Each shard is built on its GPU from the shard config with dummy weights (a 70B model never
    exists whole); each has a KV cache of its own KV heads (plain tensors, FlashInfer attention).
    The host launches every GPU's kernels from one thread, layer by layer (eager: no graphs yet).

        python3 scripts/bench_lifecycle.py tp [--preset llama-3.1-70b] [--tp 2] [--json out.json]
        python3 scripts/bench_lifecycle.py tp --cpu 2 --preset tiny-llama  # the logic only
    """
    ap = argparse.ArgumentParser(description=main_tp.__doc__)
    ap.add_argument("--preset", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=0, help="emulate N devices on the host")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-activation", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.cpu:
        devices = [torch.device("cpu")] * args.cpu
        dtype = torch.float32
    else:
        devices = [torch.device("cuda", i) for i in range(args.tp)]
        dtype = torch.bfloat16
    cfg = ModelConfig.from_hf(get_preset(args.preset))
    shards = build_shards(cfg, devices, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-(args.context + 1) // BLOCK)
    nblocks = 1 + max(batches) * blocks_per_seq
    caches = []
    for m, d in zip(shards, devices):
        c = m.config
        shape = (nblocks, 2, BLOCK, c.num_kv_heads, c.head_dim)
        caches.append([torch.zeros(shape, dtype=dtype, device=d) for _ in range(c.num_layers)])
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        for i in range(max(batches))
    ]
    backends = [backend(m, dtype, d) for m, d in zip(shards, devices)]
    ways = {
        "tp": TensorParallel(shards, devices, default_all_reduce(devices)),
        "no_reduce": TensorParallel(shards, devices, lambda xs: None),
    }
    shard_bytes = sum(p.numel() * p.element_size() for p in shards[0].parameters())
    rate = copy_rate(devices[0])
    out: dict = {
        "preset": args.preset,
        "tp": len(devices),
        "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in devices],
        "shard_weight_bytes": shard_bytes,
        "copy_gbs": rate / 1e9 if rate else None,
        "floor_ms": shard_bytes / (rate / 2) * 1e3 if rate else None,  # read once per step
    }
    for way, tp in ways.items():
        for b in batches:
            chunks = [SeqChunk(args.context, 1, tables[i]) for i in range(b)]
            out[f"{way}_decode_b{b}_ms"] = (
                step_time(tp, backends, caches, chunks, args.repeats) * 1e3
            )
        prefill = [SeqChunk(0, args.context, tables[0])]
        n = max(2, args.repeats // 3)
        out[f"{way}_prefill_ms"] = step_time(tp, backends, caches, prefill, n) * 1e3
    for b in batches:
        print(
            f"{args.preset} over {len(devices)} devices, decode B={b} ctx {args.context}: "
            f"{out[f'tp_decode_b{b}_ms']:.2f} ms a step; without the all-reduce "
            f"{out[f'no_reduce_decode_b{b}_ms']:.2f} ms; floor "
            + (f"{out['floor_ms']:.2f} ms" if out["floor_ms"] else "-")
        )
    print(
        f"prefill {args.context} tokens: {out['tp_prefill_ms']:.1f} ms; without the all-reduce "
        f"{out['no_reduce_prefill_ms']:.1f} ms"
    )
    del ways, shards, caches, backends
    gc.collect()
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_activation:
        out["activation"] = act = tp_activation(args.preset, devices, max(1, args.repeats // 3))
        print(
            f"activation of the split model: {act['activation_s']:.3f} s for "
            f"{act['weight_bytes'] / 1e9:.1f} GB ({act['aggregate_gbs']:.1f} GB/s over every "
            f"link); one shard alone {act['one_shard_alone_s']:.3f} s ({act['one_link_gbs']:.1f} "
            "GB/s, one link); target <= 1.5 s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


# --- arbitrator --------------------------------------------------------------------------------

TPOT_SLO_S = 0.050
DECODERS, DECODE_PROMPT, DECODE_OUT = 16, 512, 400
BURSTS, BURST_PROMPT = 8, 8000


def _stream(e: Engine, model: str, prompt: list[int], out: int, times: list, done):
    params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)

    def sink(o):
        if o.new_token_ids:
            times.append(time.monotonic())
        if o.finished:
            done.put(o)

    e.add_request(model, prompt, params, sink)


def run(e: Engine) -> dict:
    done: queue.SimpleQueue = queue.SimpleQueue()
    dec_times = [[] for _ in range(DECODERS)]
    for i, t in enumerate(dec_times):
        _stream(
            e,
            "decoder",
            [10 + (i * 13 + j) % 500 for j in range(DECODE_PROMPT)],
            DECODE_OUT,
            t,
            done,
        )
    while min(len(t) for t in dec_times) < 20:  # decoding steadily
        time.sleep(0.001)
    burst_times = [[] for _ in range(BURSTS)]
    arrival = time.monotonic()
    for i, t in enumerate(burst_times):
        _stream(e, "burst", [10 + (i * 7 + j) % 500 for j in range(BURST_PROMPT)], 4, t, done)
    for _ in range(DECODERS + BURSTS):
        o = done.get(timeout=600)
        assert o.error is None, o.error
    burst_end = max(t[0] for t in burst_times)
    gaps = []  # the decoder's gaps while the burst was being prefilled
    tpots = []
    for t in dec_times:
        g = [b - a for a, b in zip(t, t[1:]) if a >= arrival and b <= burst_end + 0.05]
        gaps += g
        during = [x for x in t if arrival <= x <= burst_end]
        if len(during) > 1:
            tpots.append((during[-1] - during[0]) / (len(during) - 1))
    ttfts = sorted(t[0] - arrival for t in burst_times)
    # the SLO's own measure: each request's mean TPOT over its whole output (slack a stream
    # banks before the burst may be spent during it)
    whole = [(t[-1] - t[0]) / (len(t) - 1) for t in dec_times if len(t) > 1]
    return {
        "decoder_gaps": len(gaps),
        "token_attainment": sum(g <= TPOT_SLO_S for g in gaps) / max(len(gaps), 1),
        "request_attainment": sum(x <= TPOT_SLO_S for x in tpots) / max(len(tpots), 1),
        "slo_attainment": sum(x <= TPOT_SLO_S for x in whole) / max(len(whole), 1),
        "mean_tpot_max_ms": 1e3 * max(whole),
        "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "gap_max_ms": 1e3 * max(gaps) if gaps else None,
        "burst_ttft_p50_s": ttfts[len(ttfts) // 2],
        "burst_ttft_max_s": ttfts[-1],
        "burst_s": burst_end - arrival,
    }


def trace_steps(e: Engine) -> list:
    """Records every model step once done (model, the arbitrator's token budget, tokens run,
    seconds, estimate): where the time between the decoder's tokens goes."""
    steps: list = []

    def record(m, start, shape, estimate, took):
        pick = e.worker._pick  # the engine step's arbitration, read on the engine thread
        budget = None
        if pick is not None and pick[0] is not None and pick[0].model == m.name:
            budget = pick[0].token_budget
        steps.append((m.name, budget, shape.tokens, took, estimate))

    for m in e.worker.call(lambda: list(e.worker.models.values())):
        m.on_step = record
    return steps


def summarize(steps: list) -> dict:
    out = {}
    for name in sorted({s[0] for s in steps}):
        mine = [s for s in steps if s[0] == name]
        big = [s for s in mine if s[2] > 64]
        out[name] = {
            "steps": len(mine),
            "budget_none": sum(s[1] is None for s in mine),
            "prefill_steps": len(big),
            "prefill_tokens_p50": statistics.median([s[2] for s in big]) if big else None,
            "prefill_ms_p50": 1e3 * statistics.median([s[3] for s in big]) if big else None,
            "prefill_est_ms_p50": 1e3 * statistics.median([s[4] for s in big]) if big else None,
            "budget_p50": statistics.median([s[1] for s in big if s[1]] or [0]),
        }
    return out


def main_arbitrator() -> None:
    """The arbitrator on the GPU: two 8B-shaped models on one device; one decodes 16 streams under a
    50 ms TPOT SLO while the other receives a burst of long prompts. Measured twice in the same
    process, on the same engine: with the arbitrator (prism: the long prompts are prefilled in
    chunks that fit the decoder's slack) and with round-robin (each model with work steps in turn,
    full 2,048-token prefill steps). Prints the decoder's TPOT attainment, per token (each gap
    within the SLO) and per request (mean TPOT within the SLO), and the burst's TTFT; also the
    latency model's estimates against measured steps. The SLO is on each request's mean TPOT
    (what its client sees over the stream): a stream that ran fast before the burst may have gaps
    beyond 50 ms during it and still meet it.

        python3 scripts/bench_lifecycle.py arbitrator [--json out.json]
    """
    ap = argparse.ArgumentParser(description=main_arbitrator.__doc__)
    ap.add_argument("--json")
    args = ap.parse_args()
    specs = (
        ModelSpec(
            "decoder",
            "dummy:llama-3.1-8b",
            max_model_len=4096,
            max_num_seqs=32,
            tpot_slo_ms=TPOT_SLO_S * 1e3,
            ttft_slo_ms=2000,
        ),
        ModelSpec(
            "burst",
            "dummy:llama-3.1-8b",
            max_model_len=8192,
            max_num_seqs=16,
            tpot_slo_ms=200,
            ttft_slo_ms=20000,
        ),
    )
    out = {}
    # no prefix cache: the warm-up's prompts are the measured run's, and must be computed again
    cfg = EngineConfig(
        models=specs, device="cuda", kv_budget_bytes=40 * GiB, enable_prefix_caching=False
    )
    with Engine(cfg) as e:
        steps = trace_steps(e)
        prism = e.worker.policy
        for name, pol in (("arbitrator", prism), ("round-robin", replace(prism, arbitrate=False))):
            e.worker.policy = pol
            run(e)  # warm-up of this policy (graphs, allocator)
            steps.clear()
            out[name] = run(e)
            out[name]["steps"] = summarize(steps)
        e.worker.policy = prism
        out["step_overhead_ms"] = 1e3 * e.worker.step_overhead_s
        snap = {m.name: m.latency for m in e.snapshots()[0].models}
        out["latency_model"] = {
            n: {
                "prefill_1k_ms": 1e3 * lat.prefill_1k_s,
                "decode_b16_ctx1k_ms": 1e3 * lat.decode_b16_s,
                "error": lat.error,
                "profiled_shapes": lat.profiled_shapes,
                "observed_steps": lat.observed_steps,
            }
            for n, lat in snap.items()
        }
        e.check_integrity()
    a, r = out["arbitrator"], out["round-robin"]
    print(
        f"decoder TPOT attainment under a {BURSTS} x {BURST_PROMPT}-token burst "
        f"(SLO {TPOT_SLO_S * 1e3:.0f} ms):"
    )
    for name, x in (("arbitrator", a), ("round-robin", r)):
        print(
            f"  {name:11}  SLO (mean TPOT) {100 * x['slo_attainment']:5.1f}% (worst "
            f"{x['mean_tpot_max_ms']:.1f} ms)  per token {100 * x['token_attainment']:5.1f}%  "
            f"per request over the burst {100 * x['request_attainment']:5.1f}%  "
            f"gap p50 {x['gap_p50_ms']:.1f} ms max "
            f"{x['gap_max_ms']:.1f} ms  burst TTFT p50 {x['burst_ttft_p50_s']:.2f} s max "
            f"{x['burst_ttft_max_s']:.2f} s"
        )
        print(f"    steps: {x['steps']}")
    print(f"  host time between steps (EWMA): {out['step_overhead_ms']:.2f} ms")
    for n, lat in out["latency_model"].items():
        print(f"  latency model {n}: {lat}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


COMMANDS = {
    "pool": main_pool,
    "models": main_models,
    "multi": main_multi,
    "tp": main_tp,
    "arbitrator": main_arbitrator,
}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(f"usage: bench_lifecycle.py {{{','.join(COMMANDS)}}} [args]; see --help")
    command = COMMANDS[sys.argv.pop(1)]
    sys.argv[0] = f"bench_lifecycle.py {command.__name__.removeprefix('main_')}"
    command()
