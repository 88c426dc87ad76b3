"""The LoRA benchmark: one base with dummy weights (Llama-3.1-8B's shapes by default) and
synthetic rank-16 adapters on every projection (q/k/v/o/gate/up/down; written in the PEFT format
into a temporary directory, A and B random and non-zero), in one process, each figure beside the
reference it is judged by, measured in the same run:

    python3 scripts/bench_lora.py [--json OUT]                  # the GPU run (about 5 minutes)
    python3 scripts/bench_lora.py --device cpu --preset tiny-llama --batch 4 --distinct 1,2,4 \\
        --register 8 --rank 4 --prompt 16 --tokens 8            # the CPU smoke test's scale
    python3 scripts/bench_lora.py report OUT.json               # the GPU check's table

- decode: TPOT at batch `--batch` (32) with 1, 8 and 32 distinct adapters (request i names
  adapter i mod n) against the base alone at the same batch (target: 32 distinct within +15%).
  Decode steps with adapter work replay decode graphs of their own (captured at their first
  step of each size: the warm-up step captures them), the base's steps the plain ones.
- activation: an idle adapter evicted, its activation (pages mapped, host copy -> pages) timed,
  against the host-to-device copy of its bytes from pinned memory (target: 2 ms for rank 16 on
  an 8B base).
- registry: `--register` (500) adapters registered beside the base, each with its own pages and
  host copy (their files are the distinct adapters' directories, round-robin): the time, the
  host memory it took against the adapters' bytes, and requests to a few of them at random,
  served.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.lora.synthetic import write_adapters  # noqa: E402
from models.presets import get_preset  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine.commands import Call  # noqa: E402
from prism_server.engine.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from scripts.bench_engine import ab_run_batch, fmt, get, load, ratio  # noqa: E402

MiB = 1 << 20
BASE = "m"


# --- measuring -----------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(engine: Engine, models: list[str], prompts: list[list[int]], tokens: int) -> dict:
    """Request i to models[i], all at once; TTFT per request, and TPOT = the median gap between
    tokens once every request is decoding (no prefill shares those steps)."""
    return ab_run_batch(engine, SamplingParams, prompts, tokens, models)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def decode(engine: Engine, args, names: list[str], vocab: int) -> dict:
    """The base alone, then each count of distinct adapters, at the same batch."""
    b = args.batch
    prompts = [prompt(args.prompt, 100 + i, vocab) for i in range(b)]
    mixes = {n: [names[i % n] for i in range(b)] for n in args.distinct}
    # warm-up: each mix at the batch (a decode graph each count of LoRA tiles, captured now)
    for models in ([BASE] * b, *mixes.values()):
        run_batch(engine, models, prompts, 4)
    out = {"batch": b, "base": run_batch(engine, [BASE] * b, prompts, args.tokens)}
    print(f"   base alone B={b}: TPOT {fmt(out['base']['tpot_ms'], ' ms')}", flush=True)
    for n, models in mixes.items():
        r = run_batch(engine, models, prompts, args.tokens)
        out[f"distinct_{n}"] = r
        print(
            f"   {n} distinct B={b}: TPOT {fmt(r['tpot_ms'], ' ms')} "
            f"(base alone {fmt(out['base']['tpot_ms'], ' ms')}, "
            f"x{ratio(r['tpot_ms'], out['base']['tpot_ms'])})",
            flush=True,
        )
    return out


def activation(engine: Engine, args, name: str) -> dict:
    """Evict idle adapter `name` and time its activation (on the engine thread, the device
    synced), `--repeats` times; the floor: its bytes copied from pinned host memory to the
    device, timed alike."""
    worker = engine.worker.models[BASE]

    def once() -> float:
        assert worker.evict_adapter(name) > 0, f"adapter {name} was not resident"
        sync(args.device)
        t = time.perf_counter()
        # its copy runs while the engine thread goes on: ready at the first prepare after it
        # landed (asked again at once: the time is the copy's, not a poll interval's)
        while name not in worker.adapters.prepare([name], set(), time.monotonic()):
            assert worker.adapters.by_name[name].loading is not None, f"{name} got no pages"
        sync(args.device)
        return (time.perf_counter() - t) * 1e3

    times = [engine.worker.execute(Call(once)) for _ in range(args.repeats)]
    nbytes = engine.worker.execute(Call(lambda: worker.adapters.by_name[name].buffer.nbytes))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=args.device.startswith("cuda"))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    floor = []
    for _ in range(args.repeats + 1):
        sync(args.device)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(args.device)
        floor.append((time.perf_counter() - t) * 1e3)
    out = {
        "bytes": nbytes,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "h2d_ms": statistics.median(floor[1:]),  # (the first: a warm-up)
    }
    print(
        f"   activate {nbytes / MiB:.1f} MiB: median {out['median_ms']:.3f} ms "
        f"(min {out['min_ms']:.3f}); H2D copy of its bytes {out['h2d_ms']:.3f} ms "
        f"(x{ratio(out['median_ms'], out['h2d_ms'])})",
        flush=True,
    )
    return out


def rss_bytes() -> int:
    """This process's resident memory (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def registry(engine: Engine, args, dirs: list[Path], vocab: int) -> dict:
    """`--register` more adapters (files round-robin over `dirs`), loaded together; then a
    request each to `--serve` of them at random, together."""
    names = [f"r{i}" for i in range(args.register)]
    rss = rss_bytes()
    t = time.perf_counter()
    futures = [
        engine.adapters.start_load(n, str(dirs[i % len(dirs)]), BASE) for i, n in enumerate(names)
    ]
    for f in futures:
        f.result(timeout=3600)
    seconds = time.perf_counter() - t
    host = rss_bytes() - rss
    snap = engine.worker.snapshot_now().model(BASE)
    mine = [a for a in snap.adapters if a.name in set(names)]
    adapter_bytes = sum(a.weight_bytes for a in mine)
    picked = random.Random(0).sample(names, min(args.serve, len(names)))
    prompts = [prompt(args.prompt, 900 + i, vocab) for i in range(len(picked))]
    served = run_batch(engine, picked, prompts, 4)
    out = {
        "adapters": len(mine),
        "seconds": seconds,
        "ms_each": seconds / max(len(names), 1) * 1e3,
        "host_bytes": host,
        "adapter_bytes": adapter_bytes,
        "resident": sum(a.resident for a in mine),
        "served": len(picked),
        "served_tokens": served["tokens"],
        "served_ttft_ms": served["ttft_ms"],
    }
    print(
        f"   {len(mine)} adapters registered in {seconds:.1f} s ({out['ms_each']:.1f} ms each), "
        f"{out['resident']} resident; host memory +{host / MiB:.0f} MiB "
        f"(their bytes {adapter_bytes / MiB:.0f} MiB, x{ratio(host, adapter_bytes)}); "
        f"{len(picked)} served at random: {served['tokens']} tokens, TTFT "
        f"{served['ttft_ms']:.1f} ms",
        flush=True,
    )
    return out


# --- main ----------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_lora.py", description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--preset", default="llama-3.1-8b", help="the base's shapes (dummy weights)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--distinct", default="1,8,32", help="counts of distinct adapters a batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--register", type=int, default=500, help="adapters registered at once")
    ap.add_argument("--serve", type=int, default=4, help="of those, how many get a request")
    ap.add_argument("--prompt", type=int, default=256, help="tokens a decode prompt")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a decode request")
    ap.add_argument("--repeats", type=int, default=10, help="activations timed")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.distinct = sorted({int(x) for x in args.distinct.split(",")})
    if min(args.distinct) < 1 or args.batch < 1 or args.rank < 1 or args.register < 0:
        ap.error("batch, rank and the distinct counts must be positive")
    return args


def engine_config(args) -> EngineConfig:
    spec = ModelSpec(
        BASE,
        f"dummy:{args.preset}",
        max_model_len=args.prompt + args.tokens + 64,
        max_num_seqs=max(args.batch, args.serve),
    )
    return EngineConfig(
        models=(spec,),
        device=args.device,
        max_loras=max(args.distinct),  # every distinct adapter of a batch runs in its steps
        max_lora_rank=args.rank,
        enable_prefix_caching=False,  # every prompt computed: the figures measure the steps
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    results: dict = {"device": args.device, "preset": args.preset, "rank": args.rank}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    vocab = get_preset(args.preset)["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        t = time.perf_counter()
        names = [f"a{i}" for i in range(max(args.distinct))]
        dirs = write_adapters(Path(tmp), args.preset, names, args.rank)
        print(
            f"== {len(dirs)} adapters of rank {args.rank} written ({time.perf_counter() - t:.1f} s)"
        )
        with Engine(engine_config(args)) as engine:
            names = [f"d{i}" for i in range(len(dirs))]
            for n, d in zip(names, dirs):
                engine.adapters.start_load(n, str(d), BASE).result()
            print("== decode", flush=True)
            results["decode"] = decode(engine, args, names, vocab)
            print("== activation", flush=True)
            results["activation"] = activation(engine, args, names[0])
            print("== registry", flush=True)
            results["registry"] = registry(engine, args, dirs, vocab)
            engine.check_integrity()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def main_report(argv: list[str] | None = None) -> None:
    """The table gpu_check.sh prints last: each figure beside its reference and target."""
    ap = argparse.ArgumentParser(prog="bench_lora.py report")
    ap.add_argument("json")
    r = load(ap.parse_args(argv).json)
    rows = []
    b = get(r, "decode", "batch")
    base = get(r, "decode", "base", "tpot_ms")
    for key in sorted((k for k in r.get("decode") or {} if k.startswith("distinct_")), key=len):
        n = key.removeprefix("distinct_")
        ours = get(r, "decode", key, "tpot_ms")
        target = "<= 1.15" if n == "32" else "-"
        rows.append(
            (
                f"LoRA TPOT B={b}, {n} distinct r{r.get('rank')}",
                fmt(ours, " ms"),
                f"base alone {fmt(base, ' ms')}",
                ratio(ours, base),
                target,
            )
        )
    act = r.get("activation") or {}
    mib = act.get("bytes", 0) / MiB
    rows.append(
        (
            f"LoRA activation ({mib:.1f} MiB)",
            fmt(act.get("median_ms"), " ms", 3),
            f"H2D copy {fmt(act.get('h2d_ms'), ' ms', 3)}",
            ratio(act.get("median_ms"), act.get("h2d_ms")),
            "<= 2 ms",
        )
    )
    reg = r.get("registry") or {}
    if reg:
        rows.append(
            (
                f"{reg['adapters']} adapters registered",
                f"{reg['seconds']:.1f} s ({reg['ms_each']:.1f} ms each)",
                f"{reg['served']} at random served ({reg['served_tokens']} tokens)",
                "-",
                "-",
            )
        )
        rows.append(
            (
                f"host memory of {reg['adapters']} adapters",
                f"{reg['host_bytes'] / MiB:.0f} MiB",
                f"their bytes {reg['adapter_bytes'] / MiB:.0f} MiB",
                ratio(reg["host_bytes"], reg["adapter_bytes"]),
                "-",
            )
        )
    head = ("measure", "Prism", "reference", "ratio", "target")
    w = [max(len(str(x[i])) for x in (head, *rows)) for i in range(5)]
    print(" | ".join(h.ljust(n) for h, n in zip(head, w)))
    print(" | ".join("-" * n for n in w))
    for row in rows:
        print(" | ".join(str(c).ljust(n) for c, n in zip(row, w)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["report"]:
        main_report(sys.argv[2:])
    else:
        main()
