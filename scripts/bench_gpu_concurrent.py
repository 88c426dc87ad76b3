"""Two models' decode steps at once on one GPU (two streams, MuxServe-style spatial sharing)
against one after the other on one stream (what the engine thread does): aggregate tokens/s of
two small models at batch 8 each, measured in the same run. A small model's graph replay leaves
most of the GPU idle; if two at once raise the total, running them concurrently is worth
building into the engine (each model then needs its own FlashInfer workspace).

Each model is a worker of its own (own workspace, own graph pool) on the engine's weights and
pool; its decode graph is planned once for its batch and replayed N times (every replay writes
the same KV slots and reads the same context, so each costs what a decode step costs).

    python3 scripts/bench_gpu_concurrent.py [--preset llama-3.2-1b] [--batch 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
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
        "preset": args.preset,
        "batch": args.batch,
        "context": args.context,
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
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
