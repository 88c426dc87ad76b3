"""Where the host's time goes in an eager prefill step (Llama-3.1-8B shape, bf16, dummy weights),
beside the device time it must stay ahead of. Two parts:

- the launch cost of each kind of call an eager step makes (us of host time a call, the device
  kept busy so that no launch waits on it): cuBLAS's GEMM through torch, each FlashInfer kernel
  through its Python API and through its compiled module directly, a Triton kernel, a torch
  elementwise op, a pinned host buffer, an upload of a step's small tensors;
- one step of a lone prompt (1k tokens, then 8k) on a side worker, its host timeline (each
  stage's start and end: the scheduling, the upload, the step's metadata, the attention's plan
  and its parts, the forward's launches, the logits, the sampling) beside the device's (a CUDA
  event recorded at each point: when the stream reached it): how long the device waits for the
  host before its first kernel, and whether the launches keep ahead after.

    python3 scripts/bench_gpu_prefill_host.py [--json out.json] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.request import Request  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from scripts.bench_gpu_engine import make_engine, prompt, section, side_worker  # noqa: E402

BUSY_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of device work ahead of the launches


def launch_us(fn, calls: int = 200) -> float:
    """Median host time of one call of fn (us), launched behind a long device sleep."""
    fn()
    torch.cuda.synchronize()
    times = []
    torch.cuda._sleep(BUSY_CYCLES)
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def per_call(tokens: int) -> dict:
    """Host us a call, by kind of call, at a step of `tokens` rows of the 8B shape."""
    import flashinfer
    from flashinfer.activation import get_act_and_mul_module
    from flashinfer.norm import get_norm_module
    from flashinfer.rope import get_rope_module

    from models.attention import upload as up
    from models.layers import triton_step_ops

    dev, bf = "cuda", torch.bfloat16
    t, h, inter = tokens, 4096, 14336
    x = torch.randn(t, h, device=dev, dtype=bf)
    res = torch.randn(t, h, device=dev, dtype=bf)
    w = torch.randn(6144, h, device=dev, dtype=bf)
    nw = torch.ones(h, device=dev, dtype=bf)
    gu = torch.randn(t, 2 * inter, device=dev, dtype=bf)
    act = torch.empty(t, inter, device=dev, dtype=bf)
    q = torch.randn(t, 32, 128, device=dev, dtype=bf)
    k = torch.randn(t, 8, 128, device=dev, dtype=bf)
    table = torch.randn(8192, 128, device=dev, dtype=torch.float32)
    pos = torch.arange(t, device=dev, dtype=torch.int64)
    norm_mod = get_norm_module()
    silu_mod = get_act_and_mul_module("silu").silu_and_mul
    rope_mod = get_rope_module()
    ints = [torch.arange(t, dtype=torch.int64) for _ in range(3)]
    ids = list(range(t))
    out: dict = {
        "F.linear [T,4096] x [6144,4096]": launch_us(lambda: torch.nn.functional.linear(x, w)),
        "torch add_": launch_us(lambda: res.add_(x)),
        "torch.empty": launch_us(lambda: torch.empty(t, h, device=dev, dtype=bf)),
        "fused_add_rmsnorm, API": launch_us(
            lambda: flashinfer.norm.fused_add_rmsnorm(x, res, nw, 1e-5)
        ),
        "fused_add_rmsnorm, module": launch_us(
            lambda: norm_mod.fused_add_rmsnorm(x, res, nw, 1e-5, True)
        ),
        "silu_and_mul, API": launch_us(lambda: flashinfer.activation.silu_and_mul(gu)),
        "silu_and_mul, module": launch_us(lambda: silu_mod(act, gu, True)),
        "rope in place, API": launch_us(
            lambda: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                pos, q.view(t, -1), k.view(t, -1), 128, table, is_neox=True
            )
        ),
        "rope in place, module": launch_us(
            lambda: rope_mod.apply_rope_pos_ids_cos_sin_cache(q, k, q, k, table, pos, False)
        ),
        "Triton add_rmsnorm (step ops)": launch_us(
            lambda: triton_step_ops.add_rmsnorm(x, res, nw, 1e-5)
        ),
        "Triton silu_mul (step ops)": launch_us(lambda: triton_step_ops.silu_mul(gu)),
        "pinned host buffer, 24 KiB": launch_us(
            lambda: torch.empty(24 << 10, dtype=torch.uint8, pin_memory=True)
        ),
        "upload: 3 x [T] int64": launch_us(lambda: up.upload(ints, torch.device(dev))),
        "host_ints: a list of T ints": launch_us(lambda: up.host_ints(ids, torch.int64)),
    }
    for name, us in out.items():
        print(f"   {name}: {us:.1f} us")
    return out


class Timeline:
    """Host stamps (perf_counter) and device stamps (CUDA events) of named points of a step."""

    def __init__(self):
        self.points: list[tuple[str, float, torch.cuda.Event]] = []
        self._wrapped: list[tuple[object, str, object]] = []  # (obj, attr, its own value or None)

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.points.append((name, time.perf_counter(), ev))

    def wrap(self, obj, attr: str, name: str, static: bool = False) -> None:
        """obj.attr, stamped at its call and its return (static: a class's staticmethod), until
        restore()."""
        fn = getattr(obj, attr)
        self._wrapped.append((obj, attr, vars(obj).get(attr)))

        def stamped(*a, **k):
            self.mark(f"{name} >")
            r = fn(*a, **k)
            self.mark(f"{name} <")
            return r

        setattr(obj, attr, staticmethod(stamped) if static else stamped)

    def restore(self) -> None:
        """Every wrapped attribute as it was (an instance's own override removed)."""
        for obj, attr, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)
        self._wrapped.clear()

    def report(self) -> list[dict]:
        torch.cuda.synchronize()
        _, h0, e0 = self.points[0]
        return [
            {"point": n, "host_ms": (h - h0) * 1e3, "device_ms": e0.elapsed_time(e)}
            for n, h, e in self.points
        ]


def step_timeline(engine, sizes: tuple[int, ...], runs: int = 5) -> dict:
    """A lone prompt of each size through a side worker's steps, stamped: per point, the
    host's time and the device's (medians over runs)."""
    import models.attention.base as base
    import models.attention.flashinfer_paged as fp

    me = side_worker(engine, "host-timeline")
    runner = me.runner
    tl = Timeline()
    # the step's metadata (tokens and positions riding in its upload: ModelRunner.execute)
    tl.wrap(base.AttentionMetadata, "build_with", "metadata", static=True)
    tl.wrap(fp.PagedKVIndex, "from_metadata", "index", static=True)
    tl.wrap(fp.PagedKVIndex, "pinned", "index pinned")
    tl.wrap(fp, "append_inputs", "append inputs")
    tl.wrap(base, "upload", "upload")
    tl.wrap(me.scheduler, "schedule", "schedule")
    tl.wrap(runner, "execute", "execute")
    for wrappers in getattr(runner.attention, "ragged", {}).values():
        for w in wrappers.values():
            tl.wrap(w, "plan", "ragged plan")
    tl.wrap(runner, "attention", "attention plan")
    tl.wrap(runner.model, "forward", "forward")
    tl.wrap(runner.model, "compute_logits", "logits")
    tl.wrap(me.sampler, "sample", "sample")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = {}
    try:
        for tokens in sizes:
            rows: list[list[dict]] = []
            walls = []
            for i in range(runs + 1):
                r = Request(f"host{tokens}-{i}", prompt(tokens, 900 + i), params, frozenset(), 0.0)
                me.add(r)
                torch.cuda.synchronize()
                tl.points.clear()
                t = time.perf_counter()
                tl.mark("step >")
                while r.request_id in me.requests and not r.num_output_tokens:
                    me.step(time.monotonic())
                tl.mark("step <")
                me.sync()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
                if r.request_id in me.requests:
                    me.abort(r.request_id)
                if i:  # the first is a warm-up
                    rows.append(tl.report())
            names = [p["point"] for p in rows[0]]
            med = [
                {
                    "point": n,
                    "host_ms": statistics.median(r[j]["host_ms"] for r in rows),
                    "device_ms": statistics.median(r[j]["device_ms"] for r in rows),
                }
                for j, n in enumerate(names)
            ]
            print(f"   {tokens} tokens: wall {statistics.median(walls):.2f} ms (median of {runs})")
            for p in med:
                print(
                    f"     {p['point']:<18} host {p['host_ms']:7.3f} ms   "
                    f"device {p['device_ms']:7.3f} ms"
                )
            out[tokens] = {"wall_ms": statistics.median(walls), "points": med}
    finally:
        tl.restore()
        me.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    print(f"== {torch.cuda.get_device_name()}")
    out: dict = {"device": torch.cuda.get_device_name()}
    out["per_call_us"] = section("launch cost a call (host us, device busy)")(per_call)(args.tokens)
    engine = make_engine()
    stamps = section("a lone prompt's step, host and device stamps")(step_timeline)
    out["timeline"] = stamps(engine, (args.tokens, 8192))
    engine.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
