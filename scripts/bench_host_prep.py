"""The host's share of a step before its first kernel, for A/B runs of two source trees on one
machine (no GPU needed): the step's attention metadata (`AttentionMetadata.build`: slots,
block tables, lengths) and its token and position tensors, for a long prompt, a short one, decode
batches and a mixed step; and, after each step, the latency model's update with the step's
measured time (`LatencyModel.observe`, its refits included: mean and p99 over 5000 steps). Uses
only what both trees share, so an older checkout is measured by this script too.

    git archive HEAD~1 models scheduler | tar -x -C /tmp/before
    python3 scripts/bench_host_prep.py --tree /tmp/before --label before
    python3 scripts/bench_host_prep.py --tree . --label after

Each figure is the median of 30 runs, in ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def cases(seq_chunk) -> dict[str, list]:
    """name -> the step's chunks (SeqChunk of the tree measured), block size 16."""
    rng = random.Random(0)

    def decodes(n: int, ctx: int) -> list:
        return [seq_chunk(ctx + i, 1, rng.sample(range(1, 40000), ctx // 16 + 6)) for i in range(n)]

    return {
        "prompt 8k": [seq_chunk(0, 8192, list(range(5, 5 + 513)))],
        "prompt 1k": [seq_chunk(0, 1024, list(range(5, 5 + 65)))],
        "decode B=1, 1k": decodes(1, 1024),
        "decode B=64, 1k": decodes(64, 1024),
        "512-token chunk + 63 decodes": [seq_chunk(100, 512, list(range(5, 45)))]
        + decodes(63, 1024),
    }


def median_ms(fn, runs: int = 30) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True, help="the source tree to measure")
    ap.add_argument("--label", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    from models.attention.base import AttentionMetadata, SeqChunk

    try:
        from models.attention.upload import host_ints as to_tensor
    except ImportError:  # a tree from before it

        def to_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype)

    cpu = torch.device("cpu")
    out = {}
    for name, chunks in cases(SeqChunk).items():
        positions = [p for c in chunks for p in range(c.num_computed, c.num_computed + c.num_new)]

        def tokens(positions=positions):  # the step's ids and positions, as the tree's runner
            to_tensor(positions, torch.long)
            to_tensor(positions, torch.long)

        build = median_ms(lambda chunks=chunks: AttentionMetadata.build(chunks, 16, cpu))
        out[name] = {"metadata_ms": build, "ids_positions_ms": median_ms(tokens)}
        print(
            f"{args.label}: {name}: metadata {build:.3f} ms, "
            f"ids and positions {out[name]['ids_positions_ms']:.3f} ms"
        )
    out["latency model observe"] = observe_us(args.label)
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "cases": out}, indent=1))


def observe_us(label: str) -> dict:
    """The latency model fed 5000 steps (one in ten a prefill) after a profile of 33 shapes:
    microseconds an update takes, mean and p99."""
    from scheduler.latency_model import LatencyModel, StepShape

    rng = random.Random(0)
    lm = LatencyModel()
    lm.fit_profile(
        [
            (StepShape.decode(b, b * c), 1e-3 * (1 + b / 100))
            for b in (1, 4, 16, 64)
            for c in (128, 512, 1024, 4096)
        ]
        + [(StepShape.prefill(n, 0), 2e-3 + 1e-5 * n) for n in (64, 1024)]
    )
    took = []
    for _ in range(5000):
        if rng.random() < 0.1:
            n = rng.choice([64, 512, 4096])
            shape, t = StepShape.prefill(n, 0), 2e-3 + 1e-5 * n
        else:
            b = rng.randint(1, 64)
            shape, t = StepShape.decode(b, b * rng.randint(100, 3000)), 1e-3 * (1 + b / 80)
        start = time.perf_counter()
        lm.observe(shape, t * (1 + 0.05 * rng.random()))
        took.append(time.perf_counter() - start)
    took.sort()
    res = {"mean_us": statistics.fmean(took) * 1e6, "p99_us": took[len(took) * 99 // 100] * 1e6}
    print(
        f"{label}: latency model observe: mean {res['mean_us']:.1f} us, p99 {res['p99_us']:.1f} us"
    )
    return res


if __name__ == "__main__":
    main()
