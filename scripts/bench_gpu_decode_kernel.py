"""Decode attention alone: Prism's Triton decode kernel under several settings against FlashInfer's.

Llama-3.1-8B's heads (32 query over 8 KV heads, head_dim 128), bf16, 16-token pages, on one GPU,
in the same run, for each batch of `--batches` at `--context` tokens a sequence: `--layers`
layers, each over a cache of its own (so that no layer finds its K/V in the L2), as a decode
step runs them:
- Triton's kernel with the step's rope and K/V write (the engine's decode kernel up to 16
  sequences), under each setting of `--configs` (splits:stages:waves:block_n[:warps]; splits
  up to 64, a build of its own past 16; the tile block_n at every batch, no wide tile; 4 warps
  unless named);
- FlashInfer's tensor-core decode kernel (and its merge, where it splits), K/V already written
  (the engine's above 16 sequences);
against the floor: the K/V bytes read over a 1 GiB copy's rate; and where the first setting's
time goes: the same kernel without the rope and K/V write, and with every layer over one cache
(L2-hot: what is left is the kernel's own latency, not HBM's). The figure is the kernels'
device time a layer (the profiler's sum over the step's kernels, launch gaps left out).

    python3 scripts/bench_gpu_decode_kernel.py [--batches "1 16"] [--context 1024] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.attention.base import LayerAttention  # noqa: E402
from models.attention.triton_ops import TritonDecodeKernel  # noqa: E402
from scripts.bench_gpu_l2_prefetch import gpu_start  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
CONFIGS = "16:3:2:64 16:3:2:128 16:3:2:64:8 16:3:2:128:8 16:3:2:64:2 16:4:2:64 8:3:2:64 32:3:4:64"


def device_us(fn, runs: int) -> float:
    """fn's kernels' device time (us), summed, per run: fn run `runs` times under the
    profiler after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for ev in prof.key_averages():
        if ev.key.startswith(("ProfilerStep", "cudaGraph", "Memcpy", "Memset")):
            continue
        total += getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
    return total / runs


def kernel_for(config: str, dev) -> TritonDecodeKernel:
    """The kernel of a setting splits:stages:waves:block_n[:warps] (the tile block_n and the
    setting's warps and stages at every batch: no wide tile, no dense launch's own)."""
    splits, stages, waves, block_n, *warps = (int(x) for x in config.split(":"))
    return TritonDecodeKernel(HQ, HKV, D, PAGE, dev, max_splits=splits, stages=stages,
                              waves=waves, block_n=block_n, wide_tile=False,
                              warps=warps[0] if warps else 4, dense=None)  # fmt: skip


def measure(b: int, args, gbs: float) -> dict:
    """One batch size's figures: the floor, Triton's under each setting, FlashInfer's (us a
    layer), after checking Triton's output against FlashInfer's."""
    import flashinfer

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    spec = LayerAttention(scale=D**-0.5)
    ctx, L = args.context, args.layers
    pages_a_seq = -(-(ctx + 1) // PAGE)
    n_pages = b * pages_a_seq + 1  # page 0: the null page
    caches = [torch.randn(n_pages, 2, PAGE, HKV, D, device=dev, dtype=bf16) for _ in range(L)]
    tables = (1 + torch.arange(b * pages_a_seq, device=dev, dtype=torch.int32)).view(b, -1)
    lens = torch.full((b, 1), ctx + 1, device=dev, dtype=torch.int32)  # with the new token
    slots = (tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE).contiguous()
    q = torch.randn(b, HQ, D, device=dev, dtype=bf16)
    k, v = (torch.randn(b, HKV, D, device=dev, dtype=bf16) for _ in range(2))
    # the rope table at position 0 (cos 1, sin 0): q and k as they are
    rope = torch.cat([torch.ones(b, D // 2), torch.zeros(b, D // 2)], 1).to(dev)
    new = (k, v, rope, slots)
    kv_bytes = b * (ctx + 1) * HKV * D * 2 * 2
    row: dict = {"floor_us": kv_bytes / gbs / 1e3, "triton_us": {}}
    for c in args.configs.split():
        kern = kernel_for(c, dev)
        row["triton_us"][c] = (
            device_us(lambda kern=kern: [kern(q, x, tables, lens, spec, new) for x in caches],
                      args.runs) / L
        )  # fmt: skip
    # where the first setting's time goes: without the rope and K/V write, and with every
    # layer over one cache (its K/V in the L2 after the first: what is left is not HBM's)
    kern = kernel_for(args.configs.split()[0], dev)
    row["variants_us"] = {
        "no rope or K/V write": device_us(
            lambda: [kern(q, x, tables, lens, spec) for x in caches], args.runs
        ) / L,
        "one cache (L2-hot)": device_us(
            lambda: [kern(q, caches[0], tables, lens, spec, new) for _ in caches], args.runs
        ) / L,
    }  # fmt: skip
    # FlashInfer's tensor-core decode over the same pages (the new K/V written by Triton's)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * pages_a_seq
    last = torch.full((b,), ctx + 1 - (pages_a_seq - 1) * PAGE, device=dev, dtype=torch.int32)
    w.plan(indptr, tables.flatten(), last, HQ, HKV, D, PAGE, q_data_type=bf16)
    row["flashinfer_us"] = device_us(lambda: [w.run(q, x) for x in caches], args.runs) / L
    got = TritonDecodeKernel(HQ, HKV, D, PAGE, dev)(q, caches[0], tables, lens, spec, new)
    torch.testing.assert_close(got, w.run(q, caches[0]), rtol=2e-2, atol=2e-2)
    return row


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1 16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--configs", default=CONFIGS, help="splits:stages:waves:block_n[:warps]")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "batches": {}}
    gbs = out["hbm_gbs"]
    for b in (int(x) for x in args.batches.split()):
        row = measure(b, args, gbs)
        out["batches"][b] = row
        best = min(row["triton_us"], key=row["triton_us"].get)
        print(
            f"B={b} ctx {args.context}: floor {row['floor_us']:.1f} us a layer, FlashInfer "
            f"{row['flashinfer_us']:.1f} us, Triton "
            + ", ".join(f"{c} {t:.1f}" for c, t in row["triton_us"].items())
            + f" us; best {best} ({row['triton_us'][best] / row['floor_us']:.2f} x the floor)"
        )
        print(
            f"B={b} {args.configs.split()[0]}: "
            + ", ".join(f"{k} {t:.1f} us" for k, t in row["variants_us"].items())
        )
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
