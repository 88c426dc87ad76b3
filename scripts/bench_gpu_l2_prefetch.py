"""Does asking the L2 for a weight while HBM idles make the GEMM after it faster?

Batch-1 GEMMs of Llama-3.1-8B's projections (bf16), each after a window in which the GPU
computes without touching HBM (a spin kernel of `window` us, standing in for a decode step's
attention or activation), three ways, in the same run:
- cold: the L2 flushed before the window, no prefetch;
- prefetched: the same, and the weight (or its first `--head` MiB) asked of the L2 on a side
  stream when the window opens (models.layers.l2_prefetch, the kernel the decode graphs run);
- the HBM floor: the weight's bytes over the bus's rate, measured by a copy in the same run.
Each GEMM is timed alone (CUDA events around it, after the window and the join), median of
`--runs`.

    python3 scripts/bench_gpu_l2_prefetch.py [--windows 0,5,10,20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.layers import l2_prefetch  # noqa: E402

MiB = 1 << 20
SHAPES = {  # name -> (out, in) of Llama-3.1-8B
    "o_proj": (4096, 4096),
    "qkv_proj": (6144, 4096),
    "down_proj": (4096, 14336),
    "gate_up_proj": (28672, 4096),
}


def hbm_gbs(dev) -> float:
    """The bus's rate (GB/s, read + write) by a 1 GiB copy, best of 5."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return 2 * a.numel() / best / 1e6


def gpu_start(dev) -> dict:
    """A GPU benchmark's start: torch seeded, the copy rate measured and printed with the
    device's name; both, for the benchmark's JSON."""
    torch.manual_seed(0)
    gbs = hbm_gbs(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"HBM {gbs:.0f} GB/s (1 GiB copy); {name}")
    return {"hbm_gbs": gbs, "device": name}


def spin_cycles(us: float) -> int:
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_980_000
    return int(us * clock_khz / 1e3)


def gemm_ms(
    w,
    x,
    window_us: float,
    head: int | None,
    flush,
    side,
    runs: int,
    chunk: int = l2_prefetch.CHUNK,
    keep: bool = False,
) -> float:
    """The GEMM x @ w.T alone, after a window of window_us (the L2 flushed before it), with the
    first `head` bytes of w asked of the L2 when the window opens, `chunk` bytes an instruction
    (head None: no prefetch)."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(runs + 2):
        flush.add_(1)  # evicts the weight from the L2
        if head is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch._launch(((w.data_ptr(), head), (0, 0)), True, flush, chunk, keep)
        if window_us:
            torch.cuda._sleep(spin_cycles(window_us))
        if head is not None:
            main.wait_stream(side)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.nn.functional.linear(x, w)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="0,5,10,20", help="us of idle HBM before each GEMM")
    ap.add_argument("--head", type=int, default=None, help="MiB asked (default: the whole weight)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gbs = hbm_gbs(dev)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) / MiB
    print(f"HBM {gbs:.0f} GB/s (1 GiB copy), L2 {l2:.0f} MiB; {torch.cuda.get_device_name(dev)}")
    flush = torch.zeros(256 * MiB // 4, dtype=torch.float32, device=dev)  # > the L2
    side = torch.cuda.Stream(dev)
    out = {"hbm_gbs": gbs, "rows": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        size = w.numel() * 2
        head = size if args.head is None else min(size, args.head * MiB)
        floor = size / gbs / 1e6
        for window in (float(v) for v in args.windows.split(",")):
            cold = gemm_ms(w, x, window, None, flush, side, args.runs)
            warm = gemm_ms(w, x, window, head, flush, side, args.runs)
            row = {
                "gemm": name,
                "mib": size / MiB,
                "prefetched_mib": head / MiB,
                "window_us": window,
                "cold_us": cold * 1e3,
                "prefetched_us": warm * 1e3,
                "floor_us": floor * 1e3,
            }
            out["rows"].append(row)
            print(
                f"{name} ({size / MiB:.0f} MiB, {head / MiB:.0f} asked), window {window:.0f} us: "
                f"cold {cold * 1e3:.1f} us, prefetched {warm * 1e3:.1f} us, "
                f"HBM floor {floor * 1e3:.1f} us"
            )
    # the bytes one instruction asks for: o_proj after a 10 us window
    w = torch.randn(*SHAPES["o_proj"], device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, w.shape[1], device=dev, dtype=torch.bfloat16)
    for kib in (4, 16, 64, 256):
        us = gemm_ms(w, x, 10, w.numel() * 2, flush, side, args.runs, kib << 10) * 1e3
        row = {"gemm": "o_proj", "window_us": 10, "chunk_kib": kib, "prefetched_us": us}
        out["rows"].append(row)
        print(f"o_proj, window 10 us, {kib} KiB an instruction: prefetched {us:.1f} us")
    # the lines asked to be evicted last (an evict_last policy)
    us = gemm_ms(w, x, 10, w.numel() * 2, flush, side, args.runs, keep=True) * 1e3
    out["rows"].append({"gemm": "o_proj", "window_us": 10, "keep": True, "prefetched_us": us})
    print(f"o_proj, window 10 us, evict_last: prefetched {us:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
