"""The short table gpu_check.sh prints last: each Prism figure beside its reference and target.

python3 scripts/gpu_report.py POOL_JSON ENGINE_JSON PYTEST_LOG [PEER_JSON]

PEER_JSON: the gpt-fast-style decode's figures of the same run (bench_gpu_gptfast.py), set
beside each batch it measured.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def load(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else {}


def get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def fmt(x, unit: str = "", nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def main() -> None:
    pool, eng = load(sys.argv[1]), load(sys.argv[2])
    log = Path(sys.argv[3]).read_text() if Path(sys.argv[3]).is_file() else ""
    peer = load(sys.argv[4]) if len(sys.argv) > 4 else {}
    summary = re.compile(r"\d+ (passed|failed|errors?|skipped)")
    tests = next((ln for ln in reversed(log.splitlines()) if summary.search(ln)), "-")
    rows = []
    gib = pool.get("gib", 10)
    for way, mib in (("grow", 128), ("shrink", 128), ("grow", 64), ("shrink", 64)):
        ours = get(pool, f"pool_{mib}m", f"{way}_ms")
        raw, small = get(pool, f"raw_{mib}m", f"{way}_ms"), get(pool, "raw_2m", f"{way}_ms")
        ref = f"raw {fmt(raw, ' ms')}; 2 MiB/layer {fmt(small, ' ms', 1)}"
        rows.append(
            (
                f"{way} {gib} GiB KV via pool ({mib} MiB)",
                fmt(ours, " ms"),
                ref,
                ratio(ours, raw),
                "<= 5 ms",
            )
        )
    vp = eng.get("vmm_vs_plain") or {}
    for m, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        ours, ref = get(vp, "vmm", m), get(vp, "plain", m)
        rows.append(
            (
                f"{name} B=16 1k, VMM vs plain tensor",
                fmt(ours, " ms"),
                f"plain {fmt(ref, ' ms')}",
                ratio(ours, ref),
                "<= 1.01",
            )
        )
    hbm = get(eng, "ceilings", "hbm_gbs")
    wb = get(eng, "prism", "weight_bytes")
    # a step's floor: the weights and the step's K/V over the copy rate
    targets = {1: "<= 1.2 x floor", 16: "<= 5.5 ms (H200)", 64: "< HF"}
    for b in (1, 16, 64):
        ours = get(eng, "prism", f"decode_b{b}", "tpot_ms")
        hf = get(eng, "hf", f"decode_b{b}", "tpot_ms")
        kv = get(eng, "prism", f"decode_b{b}", "kv_bytes_a_step") or 0
        floor = (wb + kv) / (hbm * 1e9) * 1e3 if wb and hbm else None
        ref = f"floor {fmt(floor, ' ms')}; HF {fmt(hf, ' ms', 1)}"
        fast = get(peer, f"decode_b{b}", "tpot_ms")
        if fast is not None:
            ref += f"; gpt-fast-style {fmt(fast, ' ms')} ({ratio(ours, fast)})"
        rows.append((f"TPOT 8B bf16 B={b} ctx 1k", fmt(ours, " ms"), ref, ratio(ours, floor),
                     targets[b]))  # fmt: skip
    mm = get(eng, "ceilings", "matmul_tflops")
    for n in (1024, 8192):
        p = get(eng, "prism", f"prefill_{n}") or {}
        ref = f"matmul {fmt(mm, ' TF/s', 0)}"
        rows.append(
            (
                f"prefill {n} tok: tok/s (TFLOP/s)",
                f"{fmt(p.get('tokens_per_s'), '', 0)} ({fmt(p.get('tflops'), '', 0)})",
                ref,
                fmt(p.get("of_matmul"), "", 3),
                "-",
            )
        )
    for key in ("profile", "profile_b64"):
        prof = eng.get(key) or {}
        gemm = get(prof, "kernel_ms_per_step", "gemm")
        other = get(prof, "kernel_ms_per_step", "other")
        ahead, replay = prof.get("step_ahead_ms"), prof.get("graph_replay_ms")
        rows.append(
            (
                f"B={prof.get('batch', '?')} step / ahead / replay (ms)",
                f"{fmt(prof.get('step_ms'))} / {fmt(ahead)} / {fmt(replay)}",
                f"GEMM {fmt(gemm)}; elementwise {fmt(other)}",
                fmt(ahead / replay if ahead and replay else None, "", 3),
                "ahead <= 1.1 x replay",
            )
        )
    for name in ("decode_b64", "prefill_8k"):
        kw = get(eng, "kv_write", name) or {}
        rows.append(
            (
                f"KV write {name} (us/layer)",
                fmt(kw.get("index_copy_us"), "", 1),
                f"append_paged_kv_cache {fmt(kw.get('append_paged_kv_cache_us'), '', 1)}",
                ratio(kw.get("index_copy_us"), kw.get("append_paged_kv_cache_us")),
                "-",
            )
        )
    w = [max(len(str(r[i])) for r in rows) for i in range(5)]
    head = ("measure", "Prism", "reference", "ratio", "target")
    w = [max(a, len(b)) for a, b in zip(w, head)]
    line = " | ".join
    print(line(h.ljust(n) for h, n in zip(head, w)))
    print(line("-" * n for n in w))
    for r in rows:
        print(line(str(c).ljust(n) for c, n in zip(r, w)))
    print(f"pytest -m gpu: {tests.strip('= ')}")
    errors = eng.get("errors") or {}
    for k, v in errors.items():
        print(f"bench error in {k}: {v}")


if __name__ == "__main__":
    main()
