"""A model too large for one GPU, split over several (tensor parallelism in one process): its
decode step and prefill time, beside the same shards with the all-reduce skipped (what the
reduce costs) and the floor (each GPU reads its shard's weights once per step, all at once).
Then its activation through the engine (devices = tp, tensor_parallel = tp: evicted, then
activated, every shard's host copy at once over its own GPU's link), beside one shard's copy
alone (what one link gives).

Each shard is built on its GPU from the shard config with dummy weights (a 70B model never
exists whole); each has a KV cache of its own KV heads (plain tensors, FlashInfer attention).
The host launches every GPU's kernels from one thread, layer by layer (eager: no graphs yet).

    python3 scripts/bench_gpu_tp.py [--preset llama-3.1-70b] [--tp 2] [--json out.json]
    python3 scripts/bench_gpu_tp.py --cpu 2 --preset tiny-llama      # the script's logic only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.attention.base import (  # noqa: E402
    AttentionMetadata,
    ForwardContext,
    SeqChunk,
    layer_specs,
)
from models.attention.torch_paged import TorchPagedAttention  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.loader import init_dummy_weights  # noqa: E402
from models.presets import get_preset  # noqa: E402
from models.registry import get_model_class  # noqa: E402
from models.tensor_parallel import TensorParallel, default_all_reduce, shard_config  # noqa: E402

BLOCK = 16


def build_shards(cfg: ModelConfig, devices: list[torch.device], dtype) -> list:
    scfg = shard_config(cfg, len(devices))
    shards = []
    for rank, dev in enumerate(devices):
        with torch.device("meta"):
            m = get_model_class(cfg.hf_architecture)(scfg)
        m = m.to_empty(device=dev).to(dtype).eval().requires_grad_(False)
        init_dummy_weights(m, seed=rank)
        shards.append(m)
    return shards


def backend(model, dtype, dev):
    """The shard's attention factory, made once: (caches, metadata) -> the step's attention."""
    if dev.type != "cuda":
        return TorchPagedAttention
    from models.attention.flashinfer_paged import AttentionShape, FlashInferBackend

    c = model.config
    shape = AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, BLOCK, dtype, dtype)
    return FlashInferBackend(shape, layer_specs(model), dev)


def sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


@torch.no_grad()
def step_time(tp: TensorParallel, backends, caches, chunks: list[SeqChunk], repeats: int) -> float:
    """Median seconds of one step of `chunks` (each shard's metadata and attention built per
    step, as an engine step would)."""
    n = sum(c.num_new for c in chunks)
    times = []
    for _ in range(repeats + 2):
        sync(tp.devices)
        t = time.perf_counter()
        ctxs, ids, pos = [], [], []
        for b, d, c in zip(backends, tp.devices, caches):
            md = AttentionMetadata.build(chunks, BLOCK, d)
            with torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext():
                ctxs.append(ForwardContext(attn=b(c, md)))  # planned on its device's stream
            ids.append(torch.full((n,), 7, dtype=torch.long, device=d))
            pos.append(
                torch.cat(
                    [torch.arange(c.num_computed, c.num_computed + c.num_new) for c in chunks]
                ).to(d)
            )
        hidden = tp(ids, pos, ctxs)[0]
        tp.compute_logits(hidden[-1:])
        sync(tp.devices)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def copy_rate(dev: torch.device) -> float | None:
    """Bytes/s of a device-to-device copy (read + write) on one GPU."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(dev)
    return 2 * src.numel() * 5 / (time.perf_counter() - t)


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation(preset: str, devices: list[torch.device], repeats: int) -> dict:
    """Seconds to activate the split model through the engine, and one shard's copy alone."""
    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine import Engine

    cuda = devices[0].type == "cuda"
    spec = ModelSpec("big", f"dummy:{preset}", max_model_len=4096, tensor_parallel=len(devices))
    cfg = EngineConfig(
        models=(spec,),
        device="cuda" if cuda else "cpu",
        devices=len(devices),
        kv_budget_bytes=4 << 30 if cuda else None,
        # the host copies of a 70B model (141 GB) exceed the default half of a 256 GiB host
        host_budget_bytes=int(0.75 * _host_ram()) if cuda else None,
        plan_interval_s=3600.0,
    )
    with Engine(cfg) as e:
        worker = e.worker.models["big"]
        times = []
        for _ in range(repeats):
            e.evict("big")
            times.append(e.activate("big"))
        shard = worker.weights.parts[0]
        host = worker.host.parts[0]
        one = []
        for _ in range(repeats):  # shard 0's copy alone (the model resident: its pages mapped)
            t = time.perf_counter()
            host.load(shard.bytes())
            one.append(time.perf_counter() - t)
        nbytes, shard_bytes = worker.weights.nbytes, shard.nbytes
        e.check_integrity()
    t_all, t_one = statistics.median(times), statistics.median(one)
    return {
        "activation_s": t_all,
        "weight_bytes": nbytes,
        "aggregate_gbs": nbytes / t_all / 1e9,
        "one_shard_alone_s": t_one,
        "one_link_gbs": shard_bytes / t_one / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=0, help="emulate N devices on the host")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-activation", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.cpu:
        devices = [torch.device("cpu")] * args.cpu
        dtype = torch.float32
    else:
        devices = [torch.device("cuda", i) for i in range(args.tp)]
        dtype = torch.bfloat16
    cfg = ModelConfig.from_hf(get_preset(args.preset))
    shards = build_shards(cfg, devices, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-(args.context + 1) // BLOCK)
    nblocks = 1 + max(batches) * blocks_per_seq
    caches = []
    for m, d in zip(shards, devices):
        c = m.config
        shape = (nblocks, 2, BLOCK, c.num_kv_heads, c.head_dim)
        caches.append([torch.zeros(shape, dtype=dtype, device=d) for _ in range(c.num_layers)])
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        for i in range(max(batches))
    ]
    backends = [backend(m, dtype, d) for m, d in zip(shards, devices)]
    ways = {
        "tp": TensorParallel(shards, devices, default_all_reduce(devices)),
        "no_reduce": TensorParallel(shards, devices, lambda xs: None),
    }
    shard_bytes = sum(p.numel() * p.element_size() for p in shards[0].parameters())
    rate = copy_rate(devices[0])
    out: dict = {
        "preset": args.preset,
        "tp": len(devices),
        "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in devices],
        "shard_weight_bytes": shard_bytes,
        "copy_gbs": rate / 1e9 if rate else None,
        "floor_ms": shard_bytes / (rate / 2) * 1e3 if rate else None,  # read once per step
    }
    for way, tp in ways.items():
        for b in batches:
            chunks = [SeqChunk(args.context, 1, tables[i]) for i in range(b)]
            out[f"{way}_decode_b{b}_ms"] = (
                step_time(tp, backends, caches, chunks, args.repeats) * 1e3
            )
        prefill = [SeqChunk(0, args.context, tables[0])]
        n = max(2, args.repeats // 3)
        out[f"{way}_prefill_ms"] = step_time(tp, backends, caches, prefill, n) * 1e3
    for b in batches:
        print(
            f"{args.preset} over {len(devices)} devices, decode B={b} ctx {args.context}: "
            f"{out[f'tp_decode_b{b}_ms']:.2f} ms a step; without the all-reduce "
            f"{out[f'no_reduce_decode_b{b}_ms']:.2f} ms; floor "
            + (f"{out['floor_ms']:.2f} ms" if out["floor_ms"] else "-")
        )
    print(
        f"prefill {args.context} tokens: {out['tp_prefill_ms']:.1f} ms; without the all-reduce "
        f"{out['no_reduce_prefill_ms']:.1f} ms"
    )
    del ways, shards, caches, backends
    gc.collect()
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_activation:
        out["activation"] = act = activation(args.preset, devices, max(1, args.repeats // 3))
        print(
            f"activation of the split model: {act['activation_s']:.3f} s for "
            f"{act['weight_bytes'] / 1e9:.1f} GB ({act['aggregate_gbs']:.1f} GB/s over every "
            f"link); one shard alone {act['one_shard_alone_s']:.3f} s ({act['one_link_gbs']:.1f} "
            "GB/s, one link); target <= 1.5 s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
