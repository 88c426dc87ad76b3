"""Figures of a sweep's JSON (PNG, Agg, no pyplot): joint SLO attainment against offered rate per
policy, memory per model over time, TTFT CDFs, and each model's residency timeline.

Every plot is a `figure_<name>(sweep) -> Figure` that a test can read back: the artists carry
labels and gids (attainment and CDF lines `label=policy`, memory layers `label="<model> weights"`
/ `"<model> KV"`, residency bars `gid="<policy>/<model>/<state>"`). What the figures draw is
computed in plot_data.py (`residency_segments`, `memory_series`, `ttft_cdf`, ...), checked
directly. matplotlib is imported here, at the top, so that importing this module is what fails
without it (the sweep catches that ImportError and leaves the plots for later);
`prism_server.bench` does not import this module. Imports nothing of the engine.

`figure_capacity(capacity)` draws a capacity sweep (capacity.py): attainment against the number
of models served.

    python -m prism_server.bench.plots SWEEP.json OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from prism_server.bench.plot_data import (
    attainment_pct,
    cdf_runs,
    memory_series,
    model_names,
    policy_names,
    residency_segments,
    run_caption,
    run_transitions,
    ttft_cdf,
)
from prism_server.bench.report import showcase_run

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI = 110

# Residency state -> bar colour; offloaded is drawn as nothing (the gap between bars).
STATE_COLORS = {
    "resident": "tab:green",
    "activating": "tab:orange",
    "draining": "tab:blue",
    "failed": "tab:red",
}
UNDRAWN_STATES = frozenset({"offloaded"})
_OTHER_STATE_COLOR = "tab:gray"


# ---- figures -------------------------------------------------------------------------------------
def _figure(**kw: Any) -> Figure:
    fig = Figure(layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def _colors(names: Sequence[str]) -> dict[str, Any]:
    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _rows(fig: Figure, n: int, **kw: Any) -> list[Axes]:
    axes = fig.subplots(max(n, 1), 1, squeeze=False, **kw)
    return [row[0] for row in axes]


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _mark(ax: Axes, points, marker: str, size: int, color, gid: str) -> None:
    """Points drawn as markers only, outside the legend (gid names them)."""
    ax.plot(
        *zip(*points),
        marker=marker,
        markersize=size,
        color=color,
        markeredgecolor="black",
        linestyle="none",
        label=f"_{gid}",
        gid=gid,
    )


def figure_attainment(sweep: Mapping[str, Any]) -> Figure:
    """Joint attainment (%) against offered rate, a line per policy (label=policy), the target
    dashed (gid "target"), each sustained rate starred (gid "<policy>/sustained"), the runs
    stopped early at their upper bound, marked with a down triangle (gid "<policy>/stopped")."""
    cfg = sweep.get("config") or {}
    policies = policy_names(sweep)
    colors = _colors(policies)
    fig = _figure(figsize=(8, 5))
    ax = fig.add_subplot()
    target = cfg.get("target")
    none_passed = []
    for p in policies:
        entry = sweep["policies"][p]
        runs = sorted(entry.get("runs") or [], key=lambda r: r["rate_rps"])
        xs = [float(r["rate_rps"]) for r in runs]
        ys = [attainment_pct(r) for r in runs]
        ax.plot(xs, ys, marker="o", color=colors[p], label=p, gid=p)
        cut = [(x, y) for x, y, r in zip(xs, ys, runs) if r.get("stopped_early")]
        if cut:  # stopped once the target was out of reach: the point is an upper bound
            _mark(ax, cut, "v", 10, colors[p], f"{p}/stopped")
        rate = entry.get("sustained_rate_rps")
        if rate is None:
            none_passed.append(p)
            continue
        run = showcase_run(entry)
        y = attainment_pct(run) if run is not None else (100.0 * target if target else math.nan)
        _mark(ax, [(rate, y)], "*", 16, colors[p], f"{p}/sustained")
        ax.annotate(
            f"{rate:.3g} req/s",
            (rate, y),
            textcoords="offset points",
            xytext=(8, -14),
            ha="left",
            color=colors[p],
            fontsize=9,
        )
    if target is not None:
        ax.axhline(
            100.0 * target,
            linestyle="--",
            color="black",
            linewidth=1,
            label=f"target {100 * target:g}%",
            gid="target",
        )
    if none_passed:
        ax.text(
            0.02,
            0.03,
            "none sustained: " + ", ".join(none_passed),
            transform=ax.transAxes,
            fontsize=9,
            color="gray",
        )
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("requests meeting TTFT and TPOT SLOs (%)")
    ax.set_title("SLO attainment vs offered rate (\u2605 = highest rate sustained)")
    ax.set_ylim(top=101)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left" if not none_passed else "center left")
    return fig


def figure_memory(sweep: Mapping[str, Any]) -> Figure:
    """Per policy (rows) its showcase run's memory over time, stacked per model: weights then KV
    (same colour, KV lighter and hatched; labels "<model> weights" / "<model> KV")."""
    policies = policy_names(sweep)
    shows = {p: showcase_run(sweep["policies"][p]) for p in policies}
    models = model_names(sweep, shows.values())
    colors = _colors(models)
    fig = _figure(figsize=(10, 2.8 * max(len(policies), 1) + 0.6))
    axes = _rows(fig, len(policies), sharey=True)
    for ax, p in zip(axes, policies):
        run = shows[p]
        ax.set_title(f"{p}: {run_caption(run, sweep['policies'][p])}", fontsize=10)
        ax.set_ylabel("GiB")
        times, series = memory_series(run or {}, models)
        if not times:
            _empty(ax, "no samples")
            continue
        base = [0.0] * len(times)
        for m in models:
            w, kv = series[m]
            top = [b + x for b, x in zip(base, w)]
            ax.fill_between(
                times,
                base,
                top,
                color=colors[m],
                alpha=0.85,
                linewidth=0,
                label=f"{m} weights",
                gid=f"{p}/{m}/weights",
            )
            base, top = top, [b + x for b, x in zip(top, kv)]
            ax.fill_between(
                times,
                base,
                top,
                facecolor=colors[m],
                alpha=0.35,
                hatch="//",
                edgecolor=colors[m],
                linewidth=0,
                label=f"{m} KV",
                gid=f"{p}/{m}/kv",
            )
            base = top
        ax.plot(times, base, color="black", linewidth=0.8, label="_total", gid=f"{p}/total")
        ax.set_xlim(times[0], max(times[-1], float((run or {}).get("duration_s") or 0)))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time in run (s)")
    if not policies:
        _empty(axes[0], "no policies")
    handles = []
    for m in models:
        handles.append(Patch(facecolor=colors[m], alpha=0.85, label=f"{m} weights"))
        handles.append(
            Patch(facecolor=colors[m], alpha=0.35, hatch="//", edgecolor=colors[m], label=f"{m} KV")
        )
    if handles:
        fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    fig.suptitle("Memory per model (showcase run per policy)")
    return fig


def figure_ttft_cdf(sweep: Mapping[str, Any]) -> Figure:
    """TTFT CDF per policy (label=policy, log x) at the highest scale every policy ran, else each
    policy's showcase run; failed requests count as infinite. The TTFT SLO as a vertical line
    (gid "ttft_slo") when every model shares one."""
    cfg = sweep.get("config") or {}
    policies = policy_names(sweep)
    colors = _colors(policies)
    runs, scale = cdf_runs(sweep)
    fig = _figure(figsize=(8, 5))
    ax = fig.add_subplot()
    ax.set_xscale("log")
    for p in policies:
        run = runs[p]
        xs, ys = ttft_cdf((run or {}).get("requests") or [])
        ax.plot(xs, ys, drawstyle="steps-post", color=colors[p], label=p, gid=p)
    slos = cfg.get("slos") or {}
    ttft_slos = {(v or {}).get("ttft_s") for v in slos.values()}
    if len(ttft_slos) == 1 and None not in ttft_slos:
        slo = float(next(iter(ttft_slos)))
        ax.axvline(
            slo,
            linestyle="--",
            color="black",
            linewidth=1,
            label=f"TTFT SLO {slo:g}s",
            gid="ttft_slo",
        )
    target = cfg.get("target")
    if target is not None:
        ax.axhline(target, linestyle=":", color="gray", linewidth=1, label="_target", gid="target")
    if scale is not None:
        rates = {round(float(r["rate_rps"]), 9) for r in runs.values() if r}
        rate = f", {next(iter(rates)):.3g} req/s" if len(rates) == 1 else ""
        ax.set_title(f"TTFT CDF at scale {scale:g}{rate} (failed = never)")
    else:
        ax.set_title("TTFT CDF, each policy's showcase run (failed = never)")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left")
    return fig


def figure_residency(sweep: Mapping[str, Any]) -> Figure:
    """Per policy (rows) its showcase run's residency timelines, a row per model: bars per state
    (gid "<policy>/<model>/<state>"), offloaded left blank."""
    policies = policy_names(sweep)
    shows = {p: showcase_run(sweep["policies"][p]) for p in policies}
    models = model_names(sweep, shows.values())
    fig = _figure(figsize=(10, (0.45 * max(len(models), 1) + 0.9) * max(len(policies), 1) + 0.6))
    axes = _rows(fig, len(policies))
    seen: set[str] = set()
    for ax, p in zip(axes, policies):
        run = shows[p]
        ax.set_title(f"{p}: {run_caption(run, sweep['policies'][p])}", fontsize=10)
        if run is None:
            _empty(ax, "no runs")
            continue
        duration = float(run.get("duration_s") or 0.0)
        for i, m in enumerate(models):
            segs = residency_segments(run_transitions(run, m), duration)
            for state in dict.fromkeys(st for _, _, st in segs):
                seen.add(state)
                if state in UNDRAWN_STATES:
                    continue
                ax.broken_barh(
                    [(s, n) for s, n, st in segs if st == state],
                    (i - 0.4, 0.8),
                    facecolors=STATE_COLORS.get(state, _OTHER_STATE_COLOR),
                    gid=f"{p}/{m}/{state}",
                    label=f"_{state}",
                )
        ax.set_yticks(range(len(models)), models)
        ax.set_ylim(len(models) - 0.5, -0.5)
        ax.set_xlim(0, duration or 1.0)
        ax.grid(alpha=0.3, axis="x")
    axes[-1].set_xlabel("time in run (s)")
    if not policies:
        _empty(axes[0], "no policies")
    order = [*STATE_COLORS, *sorted(seen - set(STATE_COLORS) - UNDRAWN_STATES)]
    handles = [
        Patch(facecolor=STATE_COLORS.get(s, _OTHER_STATE_COLOR), label=s)
        for s in order
        if s in seen or s in ("resident", "activating", "draining")
    ]
    handles.append(Patch(facecolor="white", edgecolor="lightgray", label="offloaded"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    fig.suptitle("Residency per model (showcase run per policy)")
    return fig


def figure_capacity(cap: Mapping[str, Any]) -> Figure:
    """A capacity sweep: joint attainment (%) against the number of models served, a line per
    policy (label=policy), the target dashed (gid "target"), each policy's capacity starred
    (gid "<policy>/capacity"), an n whose server did not start crossed at 0 (gid
    "<policy>/no-start") and a run stopped early at its upper bound (gid "<policy>/stopped")."""
    cfg = cap.get("config") or {}
    policies = list(cap.get("policies") or {})
    colors = _colors(policies)
    fig = _figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for p in policies:
        entry = cap["policies"][p]
        pts = [x for x in entry.get("points") or [] if x.get("run") is not None]
        xs = [x["n"] for x in pts]
        ys = [attainment_pct(x["run"]) for x in pts]
        ax.plot(xs, ys, marker="o", color=colors[p], label=p, gid=p)
        cut = [(x["n"], y) for x, y in zip(pts, ys) if x["run"].get("stopped_early")]
        if cut:
            _mark(ax, cut, "v", 10, colors[p], f"{p}/stopped")
        dead = [(x["n"], 0.0) for x in entry.get("points") or [] if x.get("run") is None]
        if dead:
            _mark(ax, dead, "X", 10, colors[p], f"{p}/no-start")
        n = entry.get("capacity")
        if n is not None:
            y = next(y for x, y in zip(pts, ys) if x["n"] == n)
            _mark(ax, [(n, y)], "*", 16, colors[p], f"{p}/capacity")
            ax.annotate(
                f"{n} models",
                (n, y),
                textcoords="offset points",
                xytext=(8, -14),
                ha="left",
                color=colors[p],
                fontsize=9,
            )
    target = cfg.get("target")
    if target is not None:
        ax.axhline(
            100.0 * target,
            linestyle="--",
            color="black",
            linewidth=1,
            label=f"target {100 * target:g}%",
            gid="target",
        )
    ax.set_xlabel("models served (the config's first n)")
    ax.set_ylabel("requests meeting TTFT and TPOT SLOs (%)")
    scale = cfg.get("scale")
    ax.set_title(
        "SLO attainment vs models served"
        + (f" at x{scale:g} their rate" if scale is not None else "")
        + " (\u2605 = capacity)"
    )
    ax.set_ylim(top=101)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Writes the figure as PNG and drops its artists."""
    fig.savefig(path, dpi=DPI)
    fig.clear()  # no pyplot registry to close it from; drop its artists now
    return Path(path)


FIGURES = {
    "attainment": figure_attainment,
    "memory": figure_memory,
    "ttft_cdf": figure_ttft_cdf,
    "residency": figure_residency,
}


def plot_sweep(sweep: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Writes attainment.png, memory.png, ttft_cdf.png, residency.png under out_dir; returns
    name -> path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in FIGURES.items():
        paths[name] = save(make(sweep), out_dir / f"{name}.png")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m prism_server.bench.plots SWEEP.json OUT_DIR", file=sys.stderr)
        return 2
    sweep = json.loads(Path(args[0]).read_text())
    for path in plot_sweep(sweep, Path(args[1])).values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
