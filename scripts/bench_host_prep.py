"""The host's share of a step before its first kernel, for A/B runs of two source trees on one
machine (no GPU needed): the step's attention metadata (`AttentionMetadata.build`: slots,
block tables, lengths) and its token and position tensors, for a long prompt, a short one, decode
batches and a mixed step. Uses only what both trees share, so an older checkout is measured by
this script too.

    git archive HEAD~1 models | tar -x -C /tmp/before
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
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
