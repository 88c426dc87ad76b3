"""Where a lone prompt's TTFT goes, through the whole engine: from add_request to the start of
its first step (the command's trip to the engine thread, the arbitration), the steps (from the
step trace: launch to tokens read), and from the last step's tokens to the client's callback
(output). Llama-3.1-8B shape, bf16, dummy weights, prefix cache off (every prompt computed).

    python3 scripts/bench_gpu_ttft.py [--json OUT] [--device cpu --model tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

GiB = 1 << 30


def lone_prompt(engine: Engine, ids: list[int]) -> tuple[float, float]:
    """(submitted, first token seen) on the perf_counter clock of the step trace."""
    seen: list[float] = []
    done = __import__("queue").SimpleQueue()

    def sink(out):
        if out.new_token_ids and not seen:
            seen.append(time.perf_counter())
        if out.error:
            done.put(out.error)
        elif out.finished:
            done.put(None)

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("m", ids, params, sink)
    err = done.get(timeout=120)
    if err:
        raise RuntimeError(err)
    return t0, seen[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--sizes", default="32,1024,8192")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    trace = Path(tempfile.mkdtemp()) / "steps"
    os.environ["PRISM_STEP_TRACE"] = str(trace)
    spec = ModelSpec(
        "m",
        f"dummy:{args.model}",
        max_model_len=16384,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
    )
    cfg = EngineConfig(
        models=(spec,),
        device=args.device,
        kv_budget_bytes=16 * GiB if args.device == "cuda" else None,
        enable_prefix_caching=False,
    )
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: list[tuple[int, float, float]] = []
    t = time.perf_counter()
    with Engine(cfg) as engine:
        load_s = time.perf_counter() - t
        overhead = engine.worker.models["m"].overhead_bytes
        print(f"load {load_s:.2f} s; device memory outside the pool {overhead / 2**20:.0f} MiB")
        vocab = engine.served["m"].vocab_size
        g = torch.Generator().manual_seed(0)
        for n in sizes:
            for r in range(args.repeats + 1):  # the first of each size warms up
                ids = torch.randint(3, vocab, (n,), generator=g).tolist()
                t0, t1 = lone_prompt(engine, ids)
                if r:
                    runs.append((n, t0, t1))
                time.sleep(0.05)  # the engine thread goes idle between prompts
    steps = []
    for f in trace.parent.glob("steps.*"):
        steps += [json.loads(line) for line in f.read_text().splitlines()]
    out: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    out |= {"load_s": load_s, "overhead_bytes": overhead}
    for n in sizes:
        rows = []
        for size, t0, t1 in runs:
            if size != n:
                continue
            mine = [s for s in steps if t0 <= s["t"] <= t1]
            if not mine:
                continue
            first, last = mine[0], mine[-1]
            rows.append(
                {
                    "ttft": t1 - t0,
                    "to_first_step": first["t"] - t0,
                    "steps": sum(s["s"] for s in mine),
                    "num_steps": len(mine),
                    "after_last_step": t1 - (last["t"] + last["s"]),
                }
            )
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
        out[f"prompt_{n}"] = med
        if med:
            print(
                f"{n:6d} tokens: TTFT {med['ttft'] * 1e3:7.2f} ms = to the first step "
                f"{med['to_first_step'] * 1e3:.2f} + {med['num_steps']:.0f} step(s) "
                f"{med['steps'] * 1e3:.2f} + after {med['after_last_step'] * 1e3:.2f} ms"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
