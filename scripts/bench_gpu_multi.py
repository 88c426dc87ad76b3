"""Several GPUs in one process: activation when every GPU loads weights at once, against one GPU
alone, and a model's move to another GPU, against its activation in place (same run).

One 8B-shaped dummy model per GPU (devices = every GPU the machine has). Each is evicted, then
activated: first on GPU 0 alone, then on every GPU at once (one thread each; every GPU has its
own engine thread and copy stream). Aggregate GB/s against the single-GPU figure shows whether
the host links load in parallel. Then GPU 0's model is moved to GPU 1 (`Engine.migrate`: built
there from its host copy) and its first request timed, beside an activation in place.

    python3 scripts/bench_gpu_multi.py [--preset llama-3.1-8b] [--repeats 3] [--json out.json]
    python3 scripts/bench_gpu_multi.py --cpu 2 --preset tiny-llama   # the script's logic only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

GiB = 1 << 30


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
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
            assert w.call(lambda w=w: w.plan_evict(first))
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


if __name__ == "__main__":
    main()
