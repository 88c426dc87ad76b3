"""Decode TPOT of one source tree, for A/B runs of two trees on the same GPU (e.g. a commit and
the one before it): Llama-3.1-8B shape, bf16, dummy weights, 1k-token prompts, batch 1 and 64.
Uses only the engine API both sides share, so an older checkout can be measured by this script.

    python3 scripts/bench_decode_ab.py --tree .baseline --label before --json before.json
    python3 scripts/bench_decode_ab.py --tree . --label after --json after.json

TPOT = the median gap between tokens once every request of the batch is decoding.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path


def run_batch(engine, sampling_params, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once to model "m"; TTFT per request, and TPOT = median gap between tokens
    once every request is decoding (so no prefill shares those steps). `sampling_params` is the
    tree's SamplingParams class (its module moved between layouts)."""
    params = sampling_params(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    times: list[list[float]] = [[] for _ in prompts]
    done: queue.SimpleQueue = queue.SimpleQueue()
    errors: list[str] = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):

        def sink(out, i=i):
            if out.new_token_ids:
                times[i].append(time.perf_counter())
            if out.error:
                errors.append(out.error)
            if out.finished:
                done.put(i)

        engine.add_request("m", p, params, sink)
    for _ in prompts:
        done.get(timeout=600)
    if errors:
        raise RuntimeError(errors[0])
    t_all = max(ts[0] for ts in times)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a >= t_all]
    return {
        "ttft_ms": statistics.mean(ts[0] - t0 for ts in times) * 1e3,
        "tpot_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "gaps": len(gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True, help="the source tree to measure")
    ap.add_argument("--label", required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine import Engine

    try:
        from scheduler.sampling_params import SamplingParams
    except ImportError:  # the layout before the scheduler package held request state
        from prism_server.sampling_params import SamplingParams

    spec = ModelSpec(
        "m",
        "dummy:llama-3.1-8b",
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
    )
    cfg = EngineConfig(
        models=(spec,), device="cuda", kv_budget_bytes=16 << 30, enable_prefix_caching=False
    )
    engine = Engine(cfg)

    def prompt(n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(300, 120000, (n,), generator=g).tolist()

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        return run_batch(engine, SamplingParams, prompts, max_tokens)["tpot_ms"]

    run([prompt(64, 0), prompt(64, 1)], 8)  # warm-up (JIT, graphs)
    out = {"label": args.label, "tree": str(args.tree)}
    for b in (int(x) for x in args.batches.split(",")):
        out[f"tpot_b{b}_ms"] = run([prompt(1024, 100 + i) for i in range(b)], args.tokens)
        print(f"{args.label}: TPOT B={b} {out[f'tpot_b{b}_ms']:.2f} ms", flush=True)
    engine.close()
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
