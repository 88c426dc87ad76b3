"""What a replay measured, per model and overall: SLO attainment (TTFT and TPOT separately and
jointly), TTFT / TPOT / end-to-end percentiles, goodput (requests per second meeting both SLOs),
errors; as a dict (JSON) and a markdown table. Computed from the per-request results only."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from prism_server.bench.replay import Result


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), nearest rank."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, round(q / 100 * len(v) + 0.5) - 1))
    return v[k]


def _summary(results: Sequence[Result], ttft_slo: float, tpot_slo: float, span: float) -> dict:
    n = len(results)
    ttft_ok = [r.ok and r.ttft is not None and r.ttft <= ttft_slo for r in results]
    tpot_ok = [r.ok and (r.tpot is None or r.tpot <= tpot_slo) for r in results]
    both = [a and b for a, b in zip(ttft_ok, tpot_ok)]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    tpots = [r.tpot for r in results if r.tpot is not None]
    e2es = [r.e2e for r in results if r.e2e is not None]
    out = {
        "requests": n,
        "errors": sum(not r.ok for r in results),
        "ttft_attainment": sum(ttft_ok) / n if n else None,
        "tpot_attainment": sum(tpot_ok) / n if n else None,
        "attainment": sum(both) / n if n else None,
        "goodput_rps": sum(both) / span if span > 0 else None,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("e2e", e2es)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q)
    return out


def report(
    results: Sequence[Result], slos: Mapping[str, tuple[float, float]], span_s: float
) -> dict:
    """slos: model -> (TTFT SLO s, TPOT SLO s); span_s: the workload's duration (for goodput)."""
    by_model: dict[str, list[Result]] = {}
    for r in results:
        by_model.setdefault(r.row.model, []).append(r)
    models = {m: _summary(rs, *slos[m], span_s) for m, rs in sorted(by_model.items())}
    ok = list(results)
    met = sum(m["attainment"] * m["requests"] for m in models.values() if m["requests"])
    overall = {
        "requests": len(ok),
        "errors": sum(m["errors"] for m in models.values()),
        "attainment": met / len(ok) if ok else None,
        "goodput_rps": met / span_s if span_s > 0 else None,
    }
    for kind in ("ttft", "tpot"):
        hit = sum(m[f"{kind}_attainment"] * m["requests"] for m in models.values())
        overall[f"{kind}_attainment"] = hit / len(ok) if ok else None
    return {"overall": overall, "models": models}


def markdown(rep: dict) -> str:
    def f(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.3f}"

    lines = [
        "| model | requests | errors | TTFT att. | TPOT att. | both | goodput req/s "
        "| TTFT p50 / p99 s | TPOT p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in rep["models"].items():
        lines.append(
            f"| {name} | {m['requests']} | {m['errors']} | {f(m['ttft_attainment'], True)} | "
            f"{f(m['tpot_attainment'], True)} | {f(m['attainment'], True)} | "
            f"{f(m['goodput_rps'])} | {f(m['ttft_p50_s'])} / {f(m['ttft_p99_s'])} | "
            f"{f(m['tpot_p50_s'])} / {f(m['tpot_p99_s'])} |"
        )
    o = rep["overall"]
    lines.append(
        f"| all | {o['requests']} | {o['errors']} | {f(o['ttft_attainment'], True)} | "
        f"{f(o['tpot_attainment'], True)} | {f(o['attainment'], True)} | {f(o['goodput_rps'])} "
        "| | |"
    )
    return "\n".join(lines)


def showcase_run(policy_entry: Mapping[str, Any]) -> dict | None:
    """The run a policy is shown by: the one at its sustained scale, else its lowest-scale run
    that ran to the end (also when the sustained scale names no run; a run stopped early saw
    only the start of the workload), else its lowest; None when it has no runs."""
    runs = list(policy_entry.get("runs") or [])
    if not runs:
        return None
    scale = policy_entry.get("sustained_scale")
    if scale is not None:
        for run in runs:
            if math.isclose(run["scale"], scale, rel_tol=1e-9, abs_tol=1e-12):
                return run
    return min(runs, key=lambda r: (bool(r.get("stopped_early")), r["scale"]))
