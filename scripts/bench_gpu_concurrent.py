"""Two models' decode steps at once on one GPU (two streams, MuxServe-style spatial sharing)
against one after the other on one stream (what the engine thread does): aggregate tokens/s of
two small models at batch 8 each, measured in the same run. A small model's graph replay leaves
most of the GPU idle; if two at once raise the total, running them concurrently is worth
building into the engine (each model then needs its own FlashInfer workspace).

Each model is a worker of its own (own workspace, own graph pool) on the engine's weights and
pool; its decode graph is planned once for its batch and replayed N times (every replay writes
the same KV slots and reads the same context, so each costs what a decode step costs).

Then the same through the whole engine: both models' requests decoding, with one lane (the
arbitrator's pick steps, one model at a time) and with two (PRISM_DECODE_LANES=2: the other
model steps at once on its own stream): aggregate tokens/s while both decode, and each model's
median gap between tokens (its TPOT).

    python3 scripts/bench_gpu_concurrent.py [--preset llama-3.2-1b] [--batch 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.model_worker import ModelWorker  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

GiB = 1 << 30


def decoding_worker(engine: Engine, name: str, batch: int, context: int) -> ModelWorker:
    """A worker of its own on `name`'s weights, its batch decoding, its graph planned for it."""
    me0 = engine.worker.models[name]
    me = ModelWorker(
        f"{name}-bench",
        me0.runner.model,
        me0.outputs.tokenizer,
        engine.pool,
        me0.scheduler.config,
        torch.bfloat16,
    )
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(ord(name[0]))
    for i in range(batch):
        ids = torch.randint(300, 30000, (context,), generator=g).tolist()
        me.add(Request(f"{name}-{i}", ids, params, frozenset(), 0.0))
    while min(r.num_output_tokens for r in me.requests.values()) < 2:
        me.step(time.monotonic())
    me.step(time.monotonic())  # a decode step: the graph of this batch size is planned
    torch.cuda.synchronize()
    return me


def graph_of(me: ModelWorker, batch: int) -> torch.cuda.CUDAGraph:
    graphs = me.runner.graphs
    return graphs.graphs[next(s for s in graphs.batch_sizes if s >= batch)].graph


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def engine_decode(lanes: int, args) -> dict:
    """Both models' `batch` requests at once through an engine with `lanes` lanes."""
    preset, batch, context, tokens = args.preset, args.batch, args.context, args.tokens
    os.environ["PRISM_DECODE_LANES"] = str(lanes)
    specs = tuple(
        ModelSpec(n, f"dummy:{preset}", max_model_len=4096, max_num_seqs=32) for n in "ab"
    )
    budget = 8 * GiB if args.device == "cuda" else None
    cfg = EngineConfig(
        models=specs, device=args.device, kv_budget_bytes=budget, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    lock = threading.Lock()
    times: dict[tuple[str, int], list[float]] = {}
    done: queue.SimpleQueue = queue.SimpleQueue()
    with Engine(cfg) as e:
        e.generate("a", [[5, 6, 7]], params)  # warm-up
        e.generate("b", [[5, 6, 7]], params)
        g = torch.Generator().manual_seed(1)
        vocab = e.served["a"].vocab_size
        for name in "ab":
            for i in range(batch):
                ids = torch.randint(3, min(vocab, 30000), (context,), generator=g).tolist()
                times[name, i] = []

                def sink(out, key=(name, i)):
                    if out.new_token_ids:
                        with lock:
                            times[key].append(time.perf_counter())
                    if out.finished or out.error:
                        done.put(out.error)

                e.add_request(name, ids, params, sink)
        errors = [done.get(timeout=300) for _ in times]
        companions = e.worker.companion_steps
    if any(errors):
        raise RuntimeError(next(x for x in errors if x))
    start = max(ts[0] for ts in times.values())  # every request decoding
    end = min(ts[-1] for ts in times.values())  # until the first ends
    window = sum(sum(start <= t <= end for t in ts) for ts in times.values())
    tpot = {
        n: statistics.median(
            b - a
            for (m, _), ts in times.items()
            if m == n
            for a, b in zip(ts, ts[1:])
            if a >= start and b <= end
        )
        * 1e3
        for n in "ab"
    }
    return {
        "lanes": lanes,
        "tok_s": window / (end - start),
        "tpot_ms": tpot,
        "companion_steps": companions,
    }


def graph_pair(args) -> dict:
    """The graph-level pair: one model's replay, both one after the other, both at once."""
    specs = tuple(
        ModelSpec(n, f"dummy:{args.preset}", max_model_len=4096, max_num_seqs=32) for n in "ab"
    )
    cfg = EngineConfig(
        models=specs, device="cuda", kv_budget_bytes=8 * GiB, enable_prefix_caching=False
    )
    with Engine(cfg) as e:
        a, b = (decoding_worker(e, n, args.batch, args.context) for n in "ab")
        ga, gb = graph_of(a, args.batch), graph_of(b, args.batch)
        sa, sb = torch.cuda.Stream(), torch.cuda.Stream()

        def alternating():
            ga.replay()
            gb.replay()

        def concurrent():
            cur = torch.cuda.current_stream()
            sa.wait_stream(cur)
            sb.wait_stream(cur)
            with torch.cuda.stream(sa):
                ga.replay()
            with torch.cuda.stream(sb):
                gb.replay()
            cur.wait_stream(sa)
            cur.wait_stream(sb)

        one = timed(ga.replay, args.iters)
        alt = timed(alternating, args.iters)
        con = timed(concurrent, args.iters)
        for me in (a, b):
            for rid in list(me.requests):
                me.abort(rid)
            me.close()
    tokens = 2 * args.batch
    out = {
        "one_step_ms": one * 1e3,
        "alternating_pair_ms": alt * 1e3,
        "concurrent_pair_ms": con * 1e3,
        "alternating_tok_s": tokens / alt,
        "concurrent_tok_s": tokens / con,
        "speedup": alt / con,
    }
    print(
        f"{args.preset} x2, batch {args.batch} each, {args.context}-token context: one step "
        f"{out['one_step_ms']:.2f} ms; a step of each, one after the other "
        f"{out['alternating_pair_ms']:.2f} ms ({out['alternating_tok_s']:.0f} tok/s), at once on "
        f"two streams {out['concurrent_pair_ms']:.2f} ms ({out['concurrent_tok_s']:.0f} tok/s): "
        f"x{out['speedup']:.2f}"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per request, engine part")
    ap.add_argument("--device", default="cuda", help="cpu: the engine part alone (a check)")
    ap.add_argument("--json")
    args = ap.parse_args()
    out: dict = {"preset": args.preset, "batch": args.batch, "context": args.context}
    if args.device == "cuda":
        out |= graph_pair(args)
    for lanes in (1, 2):
        r = engine_decode(lanes, args)
        out[f"engine_lanes_{lanes}"] = r
        print(
            f"engine, {lanes} lane(s): {r['tok_s']:.0f} tok/s while both decode; TPOT a "
            f"{r['tpot_ms']['a']:.2f} ms, b {r['tpot_ms']['b']:.2f} ms; "
            f"{r['companion_steps']} steps at once with the pick"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
