"""GPU engine benchmark: Llama-3.1-8B (dummy weights, bf16) through Prism's engine, each figure
beside the reference it is judged by, all measured in this run (DESIGN.md §7).

- ceilings: HBM bandwidth (a 4 GiB device-to-device copy, bytes read + written) and the bf16
  matmul rate (8192^3, random data);
- decode TPOT at batch 1, 16, 64 with 1k-token prompts vs weight bytes / HBM bandwidth, and vs HF
  transformers `generate` on the same model shape and batch;
- prefill throughput at 1k and 8k prompt tokens vs the matmul rate (FLOPs counted exactly);
- VMM cost: the same model and batch with the KV cache in a plain torch tensor (TensorBackend)
  vs the VMM pool, alternating, TTFT and TPOT;
- a profile of one batch-1 decode step (graph replay vs whole step; kernel time by kind);
- K/V cache writes: index_copy_ (what Prism uses) vs flashinfer.append_paged_kv_cache.

    python3 scripts/bench_gpu_engine.py [--json out.json] [--skip-hf] [--skip-append]
    PRISM_PREFILL_BACKEND=fa3 python3 scripts/bench_gpu_engine.py --speed-only   # a kernel choice
    PRISM_TRITON_PDL=1 python3 scripts/bench_gpu_engine.py --speed-only --decode-only  # decode
    python3 scripts/bench_gpu_engine.py --choices "PRISM_TRITON_PDL=1 PRISM_L2_PREFETCH=48:12:12"

--choices: decode under several kernel choices (each PRISM_* settings joined by commas; the
defaults are measured too, first), one engine at a time in this one process, in rounds (ABC ABC:
drift and noise fall on every choice alike): each round's TPOT at batches 1, 16 and 64 and graph
replay at batch 1, their medians, and in the first round where the replay's kernel time goes at
batches 1 and 16. The settings must be ones the engine reads as it starts (PRISM_*; not
CUBLASLT_*, read once a process).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.presets import get_preset  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.model_runner import DeviceResources, ModelRunner  # noqa: E402
from prism_server.model_worker import ModelWorker  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from scripts.bench_decode_ab import run_batch as ab_run_batch  # noqa: E402

MODEL = "llama-3.1-8b"
GiB = 1 << 30
RESULTS: dict = {"errors": {}}


def section(name: str):
    """Run a benchmark section; a failure is recorded and the next section still runs."""

    def wrap(fn):
        def run(*a, **k):
            t = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                out = fn(*a, **k)
            except Exception as e:  # report and go on: one broken figure must not lose the rest
                traceback.print_exc()
                RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
                out = None
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)
            return out

        return run

    return wrap


def cuda_time_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median of per-call times measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


@section("ceilings")
def ceilings() -> dict:
    n = 4 * GiB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_time_ms(lambda: dst.copy_(src))
    src.set_()  # give the 8 GiB back before the matmuls
    dst.set_()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = cuda_time_ms(lambda: a @ b)
    out = {
        "hbm_gbs": 2 * n / copy_ms / 1e6,  # read + write
        "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9,
    }
    print(f"   copy {out['hbm_gbs']:.0f} GB/s (read+write), bf16 matmul {out['matmul_tflops']:.0f}")
    return out


def spec(**kw) -> ModelSpec:
    return ModelSpec(
        "m",
        f"dummy:{MODEL}",
        max_model_len=16384,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        **kw,
    )


def make_engine(plain: bool = False) -> Engine:
    backend = "tensor" if plain else "vmm"
    cfg = EngineConfig(
        models=(spec(),),
        device="cuda",
        kv_budget_bytes=16 * GiB,
        memory_backend=backend,
        enable_prefix_caching=False,  # every prompt is computed: the figures measure the engine
    )
    return Engine(cfg)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, 120000, (n,), generator=g).tolist()


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    return ab_run_batch(engine, SamplingParams, prompts, max_tokens)


def lone(engine: Engine, ids: list[int]) -> float:
    """TTFT (ms) of one prompt sent to an idle engine (its thread done with the last request's
    clean-up: the figure is the prompt's, not the queue's)."""
    time.sleep(0.05)
    return run_batch(engine, [ids], 1)["ttft_ms"]


def weight_bytes(engine: Engine) -> int:
    return engine.model_snapshot("m").weight_bytes


DECODE_PROMPT = 1024  # tokens a decode run's prompt
DECODE_BATCHES = ((1, 128), (16, 64), (64, 64))  # (sequences, tokens each)


@section("prism decode and prefill")
def decode_tpot(engine: Engine) -> dict[int, dict]:
    """A warm-up, then each batch size's decode run over 1k-token prompts (TPOT among its
    figures), by batch size."""
    run_batch(engine, [prompt(64, 0), prompt(64, 1)], 4)
    return {
        b: run_batch(engine, [prompt(DECODE_PROMPT, 100 + i) for i in range(b)], n)
        for b, n in DECODE_BATCHES
    }


def kv_bytes_a_step(cfg, batch: int, new_tokens: int) -> int:
    """The K/V a decode step of `batch` sequences reads, on average over a run of `new_tokens`
    after DECODE_PROMPT-token prompts (bf16): with the weights, the step's floor."""
    context = DECODE_PROMPT + new_tokens // 2
    return batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def prism_decode_prefill(engine: Engine, ceil: dict, prefill: bool = True) -> dict:
    out: dict = {"weight_bytes": weight_bytes(engine)}
    cfg = engine.worker.models["m"].runner.model.config
    tokens = dict(DECODE_BATCHES)
    for b, run in decode_tpot(engine).items():
        out[f"decode_b{b}"] = {**run, "kv_bytes_a_step": kv_bytes_a_step(cfg, b, tokens[b])}
        print(f"   decode B={b}: TPOT {run['tpot_ms']:.2f} ms")
    if not prefill:
        return out
    linear = out["weight_bytes"] // 2 - 2 * cfg.vocab_size * cfg.hidden_size  # no embed, lm_head
    for n in (1024, 8192):
        ttft = statistics.median(lone(engine, prompt(n, 7 + r)) for r in range(5))
        flops = 2 * linear * n + 2 * cfg.hidden_size * cfg.vocab_size  # + lm_head, last token
        flops += 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n  # causal QK^T and PV
        rate = flops / (ttft / 1e3) / 1e12
        out[f"prefill_{n}"] = {
            "ttft_ms": ttft,
            "tokens_per_s": n / ttft * 1e3,
            "tflops": rate,
            "of_matmul": rate / ceil["matmul_tflops"] if ceil else None,
        }
        print(f"   prefill {n}: {n / ttft * 1e3:.0f} tok/s, {rate:.0f} TFLOP/s")
    # a small prompt is one step (piecewise graphs, attention eager between them): mostly fixed
    # cost, beside the decode step (a graph replay) of the same batch
    small = statistics.median(lone(engine, prompt(32, 50 + r)) for r in range(5))
    out["prefill_32"] = {"ttft_ms": small, "decode_b1_tpot_ms": out["decode_b1"]["tpot_ms"]}
    print(f"   prefill 32 tokens (one step): TTFT {small:.2f} ms")
    return out


@section("sampler")
def sampler_bench(batch: int = 64, vocab: int = 128256) -> dict:
    """A step's random sampling (temperature 0.8, top-k 50, top-p 0.9) of `batch` rows: one row
    at a time (the path of seeded rows), the batched torch filters, and FlashInfer's kernel."""
    from prism_server.sampler import Sampler, sample_batch

    x = torch.randn(batch, vocab, device="cuda") * 4
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    reqs = [Request(f"r{i}", [1], p, frozenset(), arrival_time=0.0) for i in range(batch)]
    s = Sampler(torch.device("cuda"))
    out = {
        "per_row_ms": cuda_time_ms(lambda: [s._sample_row(x[i], r) for i, r in enumerate(reqs)]),
        "batched_torch_ms": cuda_time_ms(lambda: sample_batch(x, [p] * batch, use_kernel=False)),
        "batched_kernel_ms": cuda_time_ms(lambda: sample_batch(x, [p] * batch)),
    }
    print(
        f"   sampling B={batch}: per row {out['per_row_ms']:.2f} ms, batched torch "
        f"{out['batched_torch_ms']:.2f} ms, FlashInfer kernel {out['batched_kernel_ms']:.2f} ms"
    )
    return out


def side_worker(engine: Engine, name: str) -> ModelWorker:
    """A second ModelWorker on the engine model's weights and pool, stepped from this thread
    (the engine's thread is idle between the benchmark's requests), with the engine's choice of
    attention kernels and piecewise graphs; its steps read their tokens first unless told
    otherwise."""
    me0 = engine.worker.models["m"]
    shared = engine.worker.resources
    buckets = shared.piecewise_buckets
    resources = DeviceResources(
        me0.device, shared.kernels, False, bool(buckets), max(buckets, default=None)
    )
    return ModelWorker(
        name,
        me0.runner.model,
        me0.outputs.tokenizer,
        engine.pool,
        me0.scheduler.config,
        torch.bfloat16,
        resources=resources,
    )


@section("profile small prefill steps")
def profile_prefill(engine: Engine, sizes=(32, 128, 512)) -> dict:
    """One prompt of n tokens as one step, through the piecewise graphs and eagerly: the host's
    time to launch it (until execute returns) beside the whole step (until the device is done).
    Equal: the host is the bound."""
    me = side_worker(engine, "profile-prefill")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    runner = me.runner
    kv_runner = ModelRunner(runner.model, me.kv.cache, me.device, piecewise_kv=False)
    pieces = runner.pieces
    out: dict = {}
    for n in sizes:
        for way in ("piecewise", "piecewise-kv-eager", "eager"):
            me.runner = kv_runner if way == "piecewise-kv-eager" else runner
            runner.pieces = None if way == "eager" else pieces
            host, step = [], []
            for i in range(7):
                r = Request(f"q{n}-{i}", prompt(n, 900 + i), params, frozenset(), 0.0)
                me.add(r)
                batch = me.scheduler.schedule(time.monotonic())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                me.runner.execute(batch)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                me.scheduler.finish(r)
                me.requests.pop(r.request_id)
                if i >= 2:  # after a warm-up
                    host.append(t1 - t0)
                    step.append(t2 - t0)
            h, t = statistics.median(host) * 1e3, statistics.median(step) * 1e3
            out[f"{way}_{n}"] = {"host_ms": h, "step_ms": t}
            print(f"   {n} tokens, {way}: host {h:.2f} ms of a {t:.2f} ms step")
    me.runner, runner.pieces = runner, pieces
    n = sizes[0]
    r = Request(f"q{n}-prof", prompt(n, 999), params, frozenset(), 0.0)
    me.add(r)
    batch = me.scheduler.schedule(time.monotonic())
    torch.cuda.synchronize()
    out["host_profile"] = host_profile(lambda: me.runner.execute(batch), 15)
    torch.cuda.synchronize()
    me.scheduler.finish(r)
    me.requests.pop(r.request_id)
    print(out["host_profile"])
    me.close()
    return out


def host_profile(fn, lines: int) -> str:
    """Where the host's time goes in fn (cProfile, the `lines` costliest functions)."""
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    fn()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


# fa3's kernels are CUTLASS kernels, XQA's kernel_mha, Triton's decode_kernel: attention before gemm
ATTENTION_KERNELS = (
    r"PrefillWith|DecodeWith|MergeState|PersistentVar|mha|FlashAttn|attn|decode_kernel"
)
KV_WRITE_KERNELS = r"index_copy|indexCopy|index_put|scatter|AppendPagedKV|rope_write"  # + rope


def kernel_time(fn, runs: int) -> tuple[dict, dict, list]:
    """Runs fn under the CUDA profiler: device time (ms) and launches per run by kind of kernel
    (gemm, attention, kv_write, other; prefetch: the L2 prefetches, on a side stream beside the
    others), and the kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = {"gemm": 0.0, "attention": 0.0, "kv_write": 0.0, "other": 0.0, "prefetch": 0.0}
    counts = dict.fromkeys(kinds, 0.0)
    top = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not us or ev.count == 0 or ev.key.startswith(("ProfilerStep", "cudaGraph")):
            continue
        name = ev.key
        if "l2_prefetch" in name:
            kind = "prefetch"
        elif re.search(ATTENTION_KERNELS, name):
            kind = "attention"
        elif re.search(r"gemm|gemv|cutlass|nvjet|xmma|cublas|splitKreduce", name, re.I):
            kind = "gemm"
        elif re.search(KV_WRITE_KERNELS, name, re.I):
            kind = "kv_write"
        else:
            kind = "other"
        kinds[kind] += us / runs / 1e3
        counts[kind] += ev.count / runs
        top.append((us / runs / 1e3, ev.count / runs, name[:90]))
    top.sort(reverse=True)
    return kinds, counts, top


def device_idle(fn) -> dict:
    """Runs fn under the profiler: how long the device sat idle before fn's first kernel, between
    its kernels, and after its last one (ms), on the profiler's one clock; the longest gaps
    between kernels, and what the host ran for 0.1 ms or more before the first kernel and in
    those gaps (ops and CUDA runtime calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, record_function("measured"):
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    span = next(e for e in events if e.name == "measured").time_range
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA
        and e.name != "measured"  # the marker's own span on the device's timeline
        and span.start <= e.time_range.start <= span.end
    )
    if not kernels:
        return {}
    host = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CPU
        and e.name != "measured"
        and e.time_range.end - e.time_range.start >= 100
    ]

    def during(a: float, b: float) -> list:
        return [
            f"{n[:60]} {(y - x) / 1e3:.2f}"
            for x, y, n in sorted(host, key=lambda h: h[0] - h[1])
            if x < b and y > a
        ][:6]

    busy, end, gaps = 0.0, kernels[0][0], []
    prev = ""
    for a, b, name in kernels:
        if a > end:
            gaps.append((a - end, end, a, prev[:50], name[:50]))
        busy += max(0.0, b - max(a, end))
        end, prev = max(end, b), name if b >= end else prev
    first, last = kernels[0][0], end
    gaps.sort(reverse=True)
    return {
        "before_ms": (first - span.start) / 1e3,
        "between_ms": (last - first - busy) / 1e3,
        "after_ms": (span.end - last) / 1e3,
        "wall_ms": (span.end - span.start) / 1e3,
        "host_before_first_kernel": during(span.start, first),
        "longest_gaps": [
            {"ms": g / 1e3, "after": p, "before": n, "host": during(a, b)}
            for g, a, b, p, n in gaps[:4]
        ],
    }


@section("profile long prefills")
def profile_long_prefill(engine: Engine, sizes=(1024, 8192)) -> dict:
    """One prompt of n tokens (chunks of the step budget) on a side worker: its wall time from
    the first step to the last, the device time by kind of kernel, and the GEMMs' and the
    attention's own rates (FLOPs counted as in the prefill figure)."""
    me = side_worker(engine, "profile-long")
    cfg = me.runner.model.config
    linear = weight_bytes(engine) // 2 - 2 * cfg.vocab_size * cfg.hidden_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out: dict = {}
    probe = None
    for n in sizes:
        seeds = iter(range(700 + 10 * n, 800 + 10 * n))

        def one(seeds=seeds, n=n) -> float:
            r = Request(f"long{n}-{next(seeds)}", prompt(n, next(seeds)), params, frozenset(), 0.0)
            me.add(r)
            torch.cuda.synchronize()
            t = time.perf_counter()
            while r.request_id in me.requests and not r.num_output_tokens:
                me.step(time.monotonic())
            me.sync()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            if r.request_id in me.requests:
                me.abort(r.request_id)
            return wall * 1e3

        one()  # warm-up
        probe = probe if n != sizes[0] else one  # the host profile is of the first size
        walls = [one() for _ in range(3)]
        kinds, counts, top = kernel_time(one, 1)
        wall = statistics.median(walls)
        idle = device_idle(one)
        attn_flops = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n
        busy = sum(kinds.values())
        out[f"prefill_{n}"] = row = {
            "wall_ms": wall,
            "kernel_ms": kinds,
            "launches": counts,
            "device_busy": busy / wall,
            "device_idle": idle,
            "gemm_tflops": 2 * linear * n / max(kinds["gemm"], 1e-9) / 1e9,
            "attention_tflops": attn_flops / max(kinds["attention"], 1e-9) / 1e9,
            "top_kernels": top[:10],
        }
        print(
            f"   {n} tokens: wall {wall:.2f} ms, kernels {busy:.2f} ms "
            f"({', '.join(f'{k} {v:.2f}' for k, v in kinds.items())}); GEMMs "
            f"{row['gemm_tflops']:.0f} TFLOP/s, attention {row['attention_tflops']:.0f} TFLOP/s"
        )
        print(
            "     device idle (ms): "
            + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in idle.items() if k.endswith("_ms"))
        )
        print(f"     host before the first kernel: {idle.get('host_before_first_kernel')}")
        for g in idle.get("longest_gaps", []):
            print(f"     gap {g['ms']:.3f} ms after {g['after']} (host: {g['host']})")
        for ms, c, name in top[:8]:
            print(f"     {ms:7.3f} ms  x{c:5.0f}  {name}")
    out["host_profile"] = host_profile(probe, 20)
    print(out["host_profile"])
    me.close()
    return out


@section("profile decode")
def profile_decode(engine: Engine, batch: int = 1) -> dict:
    """A second ModelWorker on the same weights and pool, stepped from this thread: decode step
    wall time, graph replay time, kernel time by kind, and where the host time goes."""
    me = side_worker(engine, "profile")
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    reqs = [Request(f"p{i}", prompt(1024, 5 + i), params, frozenset(), 0.0) for i in range(batch)]
    for r in reqs:
        me.add(r)
    while min(r.num_output_tokens for r in reqs) < 2:
        me.step(time.monotonic())
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(30):
        me.step(time.monotonic())
    step_ms = (time.perf_counter() - t) / 30 * 1e3
    # the same steps launched ahead (the engine's way on a GPU): the next step is launched
    # before this one's tokens are read, and the text is made while it runs
    me.launch_ahead = True

    def hook():
        me.flush_outputs(collect=False)

    for _ in range(3):
        me.step(time.monotonic(), while_running=hook)
    t = time.perf_counter()
    for _ in range(30):
        me.step(time.monotonic(), while_running=hook)
    ahead_ms = (time.perf_counter() - t) / 30 * 1e3
    me.sync()
    me.launch_ahead = False
    graph = me.runner.graphs.graphs[batch].graph  # planned for the live batch: replay is safe
    replay_ms = cuda_time_ms(graph.replay, iters=20)
    text = host_profile(lambda: [me.step(time.monotonic()) for _ in range(10)], 12)
    kinds, counts, top = kernel_time(lambda: [me.step(time.monotonic()) for _ in range(10)], 10)
    for r in reqs:
        me.abort(r.request_id)
    me.close()
    out = {
        "batch": batch,
        "host_profile": text,
        "step_ms": step_ms,
        "step_ahead_ms": ahead_ms,
        "graph_replay_ms": replay_ms,
        "kernel_ms_per_step": kinds,
        "kernels_per_step": counts,
        "top_kernels": top[:12],
    }
    print(
        f"   B={batch}: step {step_ms:.2f} ms, launched ahead {ahead_ms:.2f} ms, graph replay "
        f"{replay_ms:.2f} ms, kernels {kinds}"
    )
    print("\n".join(text.splitlines()[:30]))
    for ms, n, name in top[:12]:
        print(f"     {ms:7.3f} ms  x{n:5.0f}  {name}")
    return out


@section("VMM vs plain tensor")
def vmm_vs_plain(vmm: Engine, plain: Engine, repeats: int = 3) -> dict:
    prompts = [prompt(1024, 300 + i) for i in range(16)]
    run_batch(plain, [prompt(64, 0)], 4)  # warm-up
    runs: dict[str, list[dict]] = {"vmm": [], "plain": []}
    for _ in range(repeats):  # alternate, so both see the same drift
        runs["vmm"].append(run_batch(vmm, prompts, 64))
        runs["plain"].append(run_batch(plain, prompts, 64))
    out = {}
    for k, rs in runs.items():
        out[k] = {m: statistics.median(r[m] for r in rs) for m in ("ttft_ms", "tpot_ms")}
    out["ttft_ratio"] = out["vmm"]["ttft_ms"] / out["plain"]["ttft_ms"]
    out["tpot_ratio"] = out["vmm"]["tpot_ms"] / out["plain"]["tpot_ms"]
    for k in ("vmm", "plain"):
        out[k + "_runs"] = runs[k]
    print(f"   {out}")
    return out


@section("HF transformers generate")
def hf_peer(batches=(1, 16, 64), new_tokens: int = 33) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = get_preset(MODEL)
    for key in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(key, None)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(torch.float32)

    def gen(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out = {}
    for b in batches:
        ids = torch.tensor([prompt(1024, 500 + i) for i in range(b)], device="cuda")
        gen(ids, 2)  # warm-up
        t1, tn = gen(ids, 1), gen(ids, new_tokens)
        out[f"decode_b{b}"] = {"tpot_ms": (tn - t1) / (new_tokens - 1) * 1e3, "ttft_ms": t1 * 1e3}
        print(f"   HF B={b}: TPOT {out[f'decode_b{b}']['tpot_ms']:.2f} ms")
    return out


@section("KV write: one indexed store vs append_paged_kv_cache")
def kv_write() -> dict:
    import flashinfer

    from models.attention.kv_write import KVSlots, write_kv

    bs, h, d = 16, 8, 128
    cache = torch.randn(8192, 2, bs, h, d, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, lens, new in (("decode_b64", [1024] * 64, 1), ("prefill_8k", [8192], 8192)):
        nblocks = [-(-n // bs) for n in lens]
        perm = torch.randperm(8192)[: sum(nblocks)].to(torch.int32)
        indptr = torch.tensor([0, *itertools.accumulate(nblocks)], dtype=torch.int32)
        last = torch.tensor([n - (nb - 1) * bs for n, nb in zip(lens, nblocks)], dtype=torch.int32)
        slots = []
        for i, n in enumerate(lens):
            blocks = perm[indptr[i] : indptr[i + 1]].tolist()
            slots += [blocks[p // bs] * bs + p % bs for p in range(n - new, n)]
        slots_t = torch.tensor(slots, device="cuda")
        t = len(slots)
        # k and v as a layer holds them: side by side in the qkv projection's rows
        qkv = torch.randn(t, (32 + 2 * h) * d, device="cuda", dtype=torch.bfloat16)
        k, v = (x.view(t, h, d) for x in qkv[:, 32 * d :].split([h * d, h * d], dim=-1))
        at = KVSlots.of(slots_t, bs)
        ours = cuda_time_ms(lambda at=at, k=k, v=v: write_kv(cache, at, k, v), iters=50)
        append_indptr = torch.tensor([new * i for i in range(len(lens) + 1)], dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        bi, pos = flashinfer.get_batch_indices_positions(append_indptr.cuda(), seq, t)
        args = (bi, pos, cache, perm.cuda(), indptr.cuda(), last.cuda())
        theirs = cuda_time_ms(
            lambda k=k, v=v, args=args: flashinfer.append_paged_kv_cache(k, v, *args), iters=50
        )
        out[name] = {"index_copy_us": ours * 1e3, "append_paged_kv_cache_us": theirs * 1e3}
        print(f"   {name}: indexed store {ours * 1e3:.1f} us, append {theirs * 1e3:.1f} us (x32)")
    return out


def parse_choice(text: str) -> dict[str, str]:
    """'PRISM_A=1,PRISM_B=x' -> its settings ('default': none)."""
    if text == "default":
        return {}
    settings = dict(kv.split("=", 1) for kv in text.split(","))
    if not all(k.startswith("PRISM_") for k in settings):
        raise SystemExit(f"{text}: only PRISM_* settings can change between engines of a process")
    return settings


def decode_choices(choices: list[str], rounds: int, keep=lambda out: None) -> dict:
    """Each choice's engine built, measured and closed in turn, `rounds` times over; keep(out)
    after each (a run cut short keeps what it measured)."""
    out: dict = {c: {"rounds": []} for c in choices}
    for r in range(rounds):
        for c in choices:
            free0 = torch.cuda.mem_get_info()[0]
            t = time.perf_counter()
            try:
                with mock.patch.dict(os.environ, parse_choice(c)):
                    engine = make_engine()
            except Exception as e:  # this choice cannot run here: the others still do
                traceback.print_exc()
                out[c].setdefault("errors", []).append(f"{type(e).__name__}: {e}")
                continue
            load_s = time.perf_counter() - t
            try:
                got = {"load_s": load_s}
                for b, run in decode_tpot(engine).items():
                    got[f"tpot_b{b}_ms"] = run["tpot_ms"]
                for b in (1, 16) if r == 0 else (1,):  # where the time goes: the first round
                    prof = profile_decode(engine, b)
                    if prof is None:  # (its section reported why)
                        continue
                    got[f"replay_b{b}_ms"] = prof["graph_replay_ms"]
                    if r == 0:
                        out[c][f"kernels_b{b}"] = prof["kernel_ms_per_step"]
                        out[c][f"kernel_counts_b{b}"] = prof["kernels_per_step"]
            finally:
                engine.close()
                del engine
                gc.collect()
                torch.cuda.empty_cache()
            leak = (free0 - torch.cuda.mem_get_info()[0]) / GiB
            got["device_memory_not_returned_gib"] = leak
            out[c]["rounds"].append(got)
            keep(out)
            print(
                f"   [{c}] round {r + 1}: TPOT B=1 {got['tpot_b1_ms']:.3f} ms, B=16 "
                f"{got['tpot_b16_ms']:.3f} ms, B=64 {got['tpot_b64_ms']:.3f} ms; B=1 replay "
                f"{got.get('replay_b1_ms', 0):.3f} ms"
                f"{f'; {leak:.2f} GiB not returned' if leak > 0.5 else ''}"
            )
    print("   choice: TPOT B=1 / 16 / 64, B=1 replay (medians of the rounds; x the default's)")
    keys = ("tpot_b1_ms", "tpot_b16_ms", "tpot_b64_ms", "replay_b1_ms")
    for c in choices:
        got = out[c]["rounds"]
        med = {
            k: statistics.median(g[k] for g in got)
            for k in keys
            if got and all(k in g for g in got)
        }
        out[c]["median"] = med
        base = out[choices[0]].get("median", {})
        if len(med) < len(keys):
            print(f"   {c}: not measured ({'; '.join(out[c].get('errors', [])) or 'see above'})")
            continue
        ratios = " / ".join(f"x{med[k] / base[k]:.3f}" if k in base else "-" for k in keys)
        print(
            f"   {c}: {med['tpot_b1_ms']:.3f} / {med['tpot_b16_ms']:.3f} / "
            f"{med['tpot_b64_ms']:.3f} ms, {med['replay_b1_ms']:.3f} ms ({ratios})"
        )
    keep(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-append", action="store_true")
    ap.add_argument(
        "--vmm-vs-plain-only",
        action="store_true",
        help="only the VMM-vs-plain comparison, with --repeats alternations",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--speed-only",
        action="store_true",
        help="only decode TPOT and prefill, and where their time goes (a kernel choice measured "
        "beside the default)",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="with --speed-only: decode TPOT and where its time goes, no prefill",
    )
    ap.add_argument(
        "--choices",
        help="decode under each of these kernel choices (space-separated; settings of one "
        "joined by commas) beside the defaults, in one process, in rounds",
    )
    ap.add_argument("--rounds", type=int, default=2, help="with --choices")
    args = ap.parse_args()
    # which kernels the engines took, and any that fell back (the model runner's choices)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("prism_server.model_runner").setLevel(logging.INFO)

    def save(key: str, value) -> None:  # after every section: a killed run keeps what it got
        RESULTS[key] = value
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1, default=str))

    save("device", torch.cuda.get_device_name())
    save("ceilings", ceilings())
    if args.choices:
        choices = ["default"] + [c for c in args.choices.split() if c != "default"]
        keep = lambda out: save("choices", out)  # noqa: E731
        section("kernel choices")(decode_choices)(choices, args.rounds, keep)
        save("errors", RESULTS["errors"])
        return
    t = time.perf_counter()
    vmm = section("load (VMM)")(make_engine)()
    save("load_s", time.perf_counter() - t)
    if vmm is not None:
        if args.speed_only:
            save("prism", prism_decode_prefill(vmm, RESULTS["ceilings"], not args.decode_only))
            save("profile", profile_decode(vmm))
            save("profile_b16", profile_decode(vmm, 16))
            if not args.decode_only:
                save("profile_long_prefill", profile_long_prefill(vmm))
            vmm.close()
            return
        if not args.vmm_vs_plain_only:
            save("prism", prism_decode_prefill(vmm, RESULTS["ceilings"]))
            save("sampler", sampler_bench())
            save("profile", profile_decode(vmm))
            save("profile_b16", profile_decode(vmm, 16))
            save("profile_b64", profile_decode(vmm, 64))
            save("profile_long_prefill", profile_long_prefill(vmm))
            save("profile_prefill", profile_prefill(vmm))
        plain = section("load (plain tensor)")(make_engine)(plain=True)
        if plain is not None:
            save("vmm_vs_plain", vmm_vs_plain(vmm, plain, args.repeats))
            plain.close()
        vmm.close()
    if args.vmm_vs_plain_only:
        return
    del vmm
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        save("hf", hf_peer())
    if not args.skip_append:
        save("kv_write", kv_write())
    save("errors", RESULTS["errors"])
    print(json.dumps(RESULTS["errors"]))


if __name__ == "__main__":
    main()
