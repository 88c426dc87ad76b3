"""The numbers a sweep's figures draw (plots.py), read from its JSON: residency segments, memory
series, TTFT CDFs, which run each figure shows, and the policies' and models' order. Pure: no
matplotlib, nothing of the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prism_server.bench.report import showcase_run

GIB = 2**30


def residency_segments(
    transitions: Sequence[Sequence[Any]], duration_s: float
) -> list[tuple[float, float, str]]:
    """(start, length, state) over [0, duration_s] from [[t, state], ...] (each t the time the
    state was entered): the first state also covers [0, t0), the last lasts to duration_s;
    consecutive equal states are merged and zero-length segments dropped."""
    entries = sorted(((float(t), str(s)) for t, s in transitions), key=lambda e: e[0])
    if not entries or duration_s <= 0:
        return []
    raw: list[tuple[float, float, str]] = []
    for i, (t, state) in enumerate(entries):
        start = 0.0 if i == 0 else min(max(t, 0.0), duration_s)
        end = entries[i + 1][0] if i + 1 < len(entries) else duration_s
        end = min(max(end, 0.0), duration_s)
        if end > start:
            raw.append((start, end, state))
    merged: list[list[Any]] = []
    for start, end, state in raw:
        if merged and merged[-1][2] == state:
            merged[-1][1] = end
        else:
            merged.append([start, end, state])
    return [(s, e - s, st) for s, e, st in merged]


def run_transitions(run: Mapping[str, Any], model: str) -> list[list[Any]]:
    """A model's [[t, state], ...] in a run: its recorded transitions, or when it has none the
    residency seen in each status sample."""
    recorded = (run.get("transitions") or {}).get(model)
    if recorded:
        return [list(e) for e in recorded]
    out = []
    for s in sorted(run.get("samples") or [], key=lambda s: s["t"]):
        m = (s.get("models") or {}).get(model)
        if m and m.get("residency"):
            out.append([s["t"], m["residency"]])
    return out


def memory_series(
    run: Mapping[str, Any], policy_models: Sequence[str]
) -> tuple[list[float], dict[str, tuple[list[float], list[float]]]]:
    """(sample times, {model: (weights GiB, KV GiB) at each time}) from a run's samples, as
    recorded (a model absent from a sample, or a null size, counts 0)."""
    samples = sorted(run.get("samples") or [], key=lambda s: s["t"])
    times = [float(s["t"]) for s in samples]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for model in policy_models:
        w, kv = [], []
        for s in samples:
            m = (s.get("models") or {}).get(model) or {}
            w.append((m.get("weight_bytes") or 0) / GIB)
            kv.append((m.get("kv_bytes") or 0) / GIB)
        series[model] = (w, kv)
    return times, series


def ttft_cdf(requests: Iterable[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """xs: the finite TTFTs, sorted; ys[i] = (i + 1) / N over all N requests, so requests with
    no TTFT (failed) count as infinite and the curve ends at (N - failed) / N."""
    reqs = list(requests)
    xs = sorted(
        float(r["ttft_s"])
        for r in reqs
        if r.get("ttft_s") is not None and math.isfinite(r["ttft_s"])
    )
    n = len(reqs)
    return xs, [(i + 1) / n for i in range(len(xs))]


def policy_names(sweep: Mapping[str, Any]) -> list[str]:
    """The policies in the sweep, in the config's order, then any others in the result's."""
    present = list(sweep.get("policies") or {})
    order = [p for p in (sweep.get("config") or {}).get("policies") or [] if p in present]
    return order + [p for p in present if p not in order]


def model_names(sweep: Mapping[str, Any], runs: Iterable[Mapping[str, Any] | None] = ()) -> list:
    """The config's models, then any other model the runs' transitions or samples mention."""
    models = list((sweep.get("config") or {}).get("models") or [])
    extra: set[str] = set()
    for run in runs:
        if not run:
            continue
        extra.update(run.get("transitions") or {})
        for s in run.get("samples") or []:
            extra.update(s.get("models") or {})
    return models + sorted(extra - set(models))


def common_scale(sweep: Mapping[str, Any]) -> float | None:
    """The highest scale that every policy with runs ran, or None."""
    sets = []
    for entry in (sweep.get("policies") or {}).values():
        scales = {round(float(r["scale"]), 9) for r in entry.get("runs") or []}
        if scales:
            sets.append(scales)
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def cdf_runs(sweep: Mapping[str, Any]) -> tuple[dict[str, dict | None], float | None]:
    """Per policy the run its TTFT CDF is drawn from: the one at the common highest scale, else
    (no common scale: None returned as the scale) its showcase run."""
    scale = common_scale(sweep)
    out: dict[str, dict | None] = {}
    for p in policy_names(sweep):
        entry = sweep["policies"][p]
        run = None
        if scale is not None:
            run = next(
                (r for r in entry.get("runs") or [] if math.isclose(r["scale"], scale)), None
            )
        out[p] = run if run is not None else showcase_run(entry)
    return out, scale


def attainment_pct(run: Mapping[str, Any]) -> float:
    """A run's joint attainment (%); a run stopped early, its upper bound."""
    if run.get("stopped_early"):
        return 100.0 * run["stopped_early"]["attainment_at_most"]
    a = ((run.get("report") or {}).get("overall") or {}).get("attainment")
    return math.nan if a is None else 100.0 * a


def run_caption(run: Mapping[str, Any] | None, entry: Mapping[str, Any]) -> str:
    if run is None:
        return "no runs"
    sustained = entry.get("sustained_scale")
    if sustained is not None and math.isclose(run["scale"], sustained):
        why = "sustained"
    else:
        why = "none sustained, lowest scale"
    return f"{run['rate_rps']:.3g} req/s (scale {run['scale']:g}, {why})"
