"""Model lifecycle on the GPU: activation from the pinned host copy against the H2D bandwidth
measured in the same run; time to first token for requests that each find their model
offloaded (two 8B models that cannot both be resident, alternating); evict -> the pages as
another model's KV; a resident model's TPOT while another activates, against without; start-up
time of eight models.

    python3 scripts/bench_gpu_lifecycle.py [--json out.json] [--switches 20] [--only a,b]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool import HostCopy  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.memory_budget import weight_pool_bytes  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

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
                assert w.make_resident(w.models["a"], time.monotonic(), wait=True)
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


def main() -> None:
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


if __name__ == "__main__":
    main()
