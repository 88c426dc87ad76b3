"""The sweep figures, read back from their artists: every plotted number is the sweep's (lines,
stacked memory, residency bars, CDFs), the helpers agree with hand-worked cases, and the PNGs
are written. Synthetic sweeps only; no server."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from prism_server.bench.plot_data import memory_series, residency_segments, ttft_cdf
from prism_server.bench.plots import (
    figure_attainment,
    figure_memory,
    figure_residency,
    figure_ttft_cdf,
    plot_sweep,
)
from prism_server.bench.report import showcase_run

GIB = 2**30
MODELS = ["a", "b", "c"]
POLICIES = ["prism", "static", "swap"]
DURATION = 10.0
BASE_RATE = 2.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# policy -> (scale -> joint attainment, sustained scale)
ATTAINMENT = {
    "prism": ({1.0: 1.0, 2.0: 0.995, 4.0: 0.9}, 2.0),
    "static": ({1.0: 0.99, 2.0: 0.95}, 1.0),
    "swap": ({0.5: 0.98, 1.0: 0.9, 2.0: 0.7}, None),  # nothing passed
}
# policy -> model -> residency transitions (the same in every run of the policy)
TRANSITIONS = {
    "prism": {
        "a": [[0.0, "resident"], [4.0, "resident"]],  # a repeat: one bar
        "b": [
            [0.0, "resident"],
            [3.2, "draining"],
            [3.25, "offloaded"],
            [7.0, "activating"],
            [7.3, "resident"],
        ],
        # starts late (offloaded before too), a zero-length draining that vanishes
        "c": [
            [0.5, "offloaded"],
            [5.0, "activating"],
            [5.6, "resident"],
            [8.0, "draining"],
            [8.0, "resident"],
        ],
    },
    "static": {
        "a": [[0.0, "resident"]],
        "b": [[0.0, "resident"]],
        "c": [[0.0, "offloaded"]],  # never fits: no bar at all
    },
    "swap": {
        "a": [
            [0.0, "resident"],
            [2.0, "draining"],
            [2.5, "offloaded"],
            [6.0, "activating"],
            [6.5, "resident"],
        ],
        "b": [[0.0, "offloaded"], [2.5, "activating"], [3.0, "resident"], [9.0, "failed"]],
        "c": [[0.0, "activating"], [1.0, "resident"], [6.0, "draining"], [6.5, "offloaded"]],
    },
}


def state_at(transitions, t):
    state = transitions[0][1]
    for when, s in sorted(transitions, key=lambda e: e[0]):
        if when <= t:
            state = s
    return state


def make_run(policy: str, scale: float, attainment: float) -> dict:
    n = int(8 * scale) + 4
    requests = []
    for i in range(n):
        ttft = round(0.02 * (i + 1) * scale * (1 + POLICIES.index(policy)), 6)
        requests.append(
            {
                "model": MODELS[i % 3],
                "prompt_len": 100 + i,
                "output_len": 20,
                "arrival_s": 0.1 * i,
                "sent_s": 0.1 * i,
                "ttft_s": ttft,
                "tpot_s": 0.01,
                "e2e_s": ttft + 0.2,
                "tokens": 20,
                "error": None,
                "waited_activation": False,
            }
        )
    requests.reverse()  # not in TTFT order
    if policy == "swap" and scale == 2.0:  # one failure, at the scale all policies ran
        requests[3].update(ttft_s=None, tpot_s=None, e2e_s=None, tokens=0, error="boom")
    trans = copy.deepcopy(TRANSITIONS[policy])
    samples = []
    for k in range(20):
        t = 0.5 * k
        models = {}
        for j, m in enumerate(MODELS):
            if policy == "prism" and m == "c" and k == 0:
                continue  # not yet in the status: counts 0
            res = state_at(trans[m], t)
            on = res not in ("offloaded", "failed")
            models[m] = {
                "device": "cuda:0",
                "residency": res,
                "weight_bytes": (j + 1) * 2 * GIB // 3 if on else 0,
                "kv_bytes": int((j + 1) * 0.25 * GIB * scale + k * 10**7) if on else 0,
                "kv_used_bytes": 10**7 * k,
            }
        samples.append({"t": t, "models": models})
    samples.reverse()  # the helpers sort by time
    if policy == "swap":
        del trans["c"]  # its timeline comes from the samples
    report_models = {m: {"attainment": attainment} for m in MODELS}
    return {
        "scale": scale,
        "rate_rps": BASE_RATE * scale,
        "duration_s": DURATION,
        "report": {
            "overall": {
                "attainment": attainment,
                "ttft_attainment": attainment,
                "tpot_attainment": 1.0,
                "requests": n,
            },
            "models": report_models,
        },
        "requests": requests,
        "samples": samples,
        "transitions": trans,
        "activations": 3,
        "evictions": 2,
    }


def make_sweep() -> dict:
    policies = {}
    for p in POLICIES:
        atts, sustained = ATTAINMENT[p]
        policies[p] = {
            "sustained_scale": sustained,
            "sustained_rate_rps": None if sustained is None else BASE_RATE * sustained,
            "runs": [make_run(p, s, a) for s, a in sorted(atts.items())],
        }
    return {
        "config": {
            "target": 0.99,
            "policies": POLICIES,
            "models": MODELS,
            "slos": {m: {"ttft_s": 0.5, "tpot_s": 0.1} for m in MODELS},
            "base_rate_rps": BASE_RATE,
        },
        "policies": policies,
    }


def run_at(sweep, policy, scale):
    return next(r for r in sweep["policies"][policy]["runs"] if r["scale"] == scale)


def lines_by_label(ax):
    return {ln.get_label(): ln for ln in ax.get_lines()}


def bars(ax):
    """gid -> [(start, length)] and gid -> row centre, from the broken_barh rectangles."""
    segs, rows = {}, {}
    for coll in ax.collections:
        gid = coll.get_gid()
        if gid is None:
            continue
        out = []
        for path in coll.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            out.append((xs.min(), xs.max() - xs.min()))
            rows.setdefault(gid, set()).add(round((ys.min() + ys.max()) / 2, 9))
        segs[gid] = out
    return segs, rows


def same(got, want):
    """Segment lists equal: numbers to float tolerance, states exactly."""
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert list(g[:2]) == pytest.approx(list(w[:2])), (got, want)
        assert tuple(g[2:]) == tuple(w[2:]), (got, want)
    return True


def band(coll, t):
    """(lower, upper) of a fill_between layer at sample time t, from its polygon."""
    v = coll.get_paths()[0].vertices
    ys = v[v[:, 0] == t][:, 1]
    return ys.min(), ys.max()


# ---- helpers ------------------------------------------------------------------------------------
def test_showcase_run_is_the_sustained_scale_else_the_lowest():
    sweep = make_sweep()
    assert showcase_run(sweep["policies"]["prism"])["scale"] == 2.0
    assert showcase_run(sweep["policies"]["static"])["scale"] == 1.0
    swap = sweep["policies"]["swap"]
    swap["runs"].reverse()
    assert showcase_run(swap)["scale"] == 0.5  # none passed: the lowest, whatever the order
    lowest = min(swap["runs"], key=lambda r: r["scale"])
    lowest["stopped_early"] = {"at_s": 1.0, "missed": 1, "sent": 1, "attainment_at_most": 0.9}
    assert showcase_run(swap)["scale"] > 0.5  # the lowest that ran to the end
    assert showcase_run({"sustained_scale": None, "runs": []}) is None


def test_residency_segments():
    b = TRANSITIONS["prism"]["b"]
    got = residency_segments(b, DURATION)
    want = [
        (0.0, 3.2, "resident"),
        (3.2, 0.05, "draining"),
        (3.25, 3.75, "offloaded"),
        (7.0, 0.3, "activating"),
        (7.3, 2.7, "resident"),
    ]
    assert same(got, want)
    # the first state covers [0, t0); a zero-length state drops and its neighbours merge
    c = residency_segments(TRANSITIONS["prism"]["c"], DURATION)
    assert same(c, [(0.0, 5.0, "offloaded"), (5.0, 0.6, "activating"), (5.6, 4.4, "resident")])
    assert residency_segments([[0, "resident"], [4, "resident"]], 10) == [(0.0, 10.0, "resident")]
    # past the run's end: clipped; unsorted input: sorted
    assert residency_segments([[12, "offloaded"], [0, "resident"]], 10) == [(0.0, 10.0, "resident")]
    assert residency_segments([], 10) == []


def test_memory_series_sorts_samples_and_counts_absent_models_zero():
    run = {
        "samples": [
            {"t": 1.0, "models": {"a": {"weight_bytes": GIB, "kv_bytes": GIB // 2}}},
            {"t": 0.0, "models": {"a": {"weight_bytes": 2 * GIB, "kv_bytes": None}}},
        ]
    }
    times, series = memory_series(run, ["a", "b"])
    assert times == [0.0, 1.0]
    assert series == {"a": ([2.0, 1.0], [0.0, 0.5]), "b": ([0.0, 0.0], [0.0, 0.0])}
    assert memory_series({}, ["a"]) == ([], {"a": ([], [])})


def test_ttft_cdf_counts_failures_as_never():
    reqs = [{"ttft_s": 0.3}, {"ttft_s": None, "error": "x"}, {"ttft_s": 0.1}, {"ttft_s": 0.2}]
    assert ttft_cdf(reqs) == ([0.1, 0.2, 0.3], [0.25, 0.5, 0.75])
    assert ttft_cdf([]) == ([], [])


# ---- figures ------------------------------------------------------------------------------------
def test_attainment_lines_are_the_runs():
    sweep = make_sweep()
    (ax,) = figure_attainment(sweep).axes
    lines = lines_by_label(ax)
    for p in POLICIES:
        runs = sweep["policies"][p]["runs"]
        assert list(lines[p].get_xdata()) == [r["rate_rps"] for r in runs]
        assert list(lines[p].get_ydata()) == pytest.approx(
            [100 * r["report"]["overall"]["attainment"] for r in runs]
        )
    target = next(ln for ln in ax.get_lines() if ln.get_gid() == "target")
    assert list(target.get_ydata()) == [99.0, 99.0] and target.get_linestyle() == "--"
    stars = {
        ln.get_gid(): ln for ln in ax.get_lines() if (ln.get_gid() or "").endswith("/sustained")
    }
    assert set(stars) == {"prism/sustained", "static/sustained"}  # swap sustained nothing
    assert list(stars["prism/sustained"].get_xdata()) == [4.0]
    assert list(stars["prism/sustained"].get_ydata()) == pytest.approx([99.5])
    assert list(stars["static/sustained"].get_xdata()) == [2.0]


def test_a_run_stopped_early_is_plotted_at_its_bound():
    sweep = make_sweep()
    run = sweep["policies"]["swap"]["runs"][-1]
    run["stopped_early"] = {"at_s": 3.0, "missed": 2, "sent": 5, "attainment_at_most": 0.8}
    (ax,) = figure_attainment(sweep).axes
    assert list(lines_by_label(ax)["swap"].get_ydata())[-1] == pytest.approx(80.0)
    (cut,) = [ln for ln in ax.get_lines() if ln.get_gid() == "swap/stopped"]
    assert list(cut.get_xdata()) == [run["rate_rps"]] and list(cut.get_ydata()) == [80.0]
    assert not [ln for ln in ax.get_lines() if ln.get_gid() == "prism/stopped"]


def test_residency_bars_are_the_segments():
    sweep = make_sweep()
    fig = figure_residency(sweep)
    assert len(fig.axes) == 3
    for ax, p in zip(fig.axes, POLICIES):
        run = showcase_run(sweep["policies"][p])
        assert ax.get_title().startswith(p) and f"{run['rate_rps']:g} req/s" in ax.get_title()
        segs, rows = bars(ax)
        assert all(g.startswith(f"{p}/") for g in segs)
        assert not any(g.endswith("/offloaded") for g in segs)
        for i, m in enumerate(MODELS):
            trans = run["transitions"].get(m) or [
                [s["t"], s["models"][m]["residency"]] for s in run["samples"]
            ]
            want = residency_segments(trans, DURATION)
            for state in {s for *_, s in want} - {"offloaded"}:
                gid = f"{p}/{m}/{state}"
                assert same(segs[gid], [(s, n) for s, n, st in want if st == state])
                assert rows[gid] == {i}
            drawn = {g.split("/")[2] for g in segs if g.split("/")[1] == m}
            assert drawn == {s for *_, s in want} - {"offloaded"}
    prism, static, swap = (bars(ax)[0] for ax in fig.axes)
    # prism/b: offloaded over [3.25, 7.0): nothing covers t = 5
    covering = [
        (g, s, n)
        for g, ss in prism.items()
        if g.startswith("prism/b/")
        for s, n in ss
        if s <= 5.0 < s + n
    ]
    assert covering == []
    assert same(prism["prism/b/resident"], [(0.0, 3.2), (7.3, 2.7)])
    assert same(prism["prism/a/resident"], [(0.0, DURATION)])
    assert "prism/c/draining" not in prism  # zero-length: gone
    assert not any(g.startswith("static/c/") for g in static)  # never resident
    # swap/c has no transitions: read from the samples (0.5 s apart)
    assert same(swap["swap/c/activating"], [(0.0, 1.0)])
    assert same(swap["swap/c/resident"], [(1.0, 5.0)])
    assert same(swap["swap/c/draining"], [(6.0, 0.5)])
    assert same(swap["swap/b/failed"], [(9.0, 1.0)])


def test_memory_stack_tops_are_the_samples_totals():
    sweep = make_sweep()
    fig = figure_memory(sweep)
    assert len(fig.axes) == 3
    for ax, p in zip(fig.axes, POLICIES):
        run = showcase_run(sweep["policies"][p])
        assert ax.get_title().startswith(p) and f"{run['rate_rps']:g} req/s" in ax.get_title()
        layers = {c.get_label(): c for c in ax.collections}
        assert set(layers) == {f"{m} {kind}" for m in MODELS for kind in ("weights", "KV")}
        samples = sorted(run["samples"], key=lambda s: s["t"])
        top = layers[f"{MODELS[-1]} KV"]
        for s in samples:
            ms = s["models"]
            total = sum(ms[m]["weight_bytes"] + ms[m]["kv_bytes"] for m in ms) / GIB
            assert band(top, s["t"])[1] == pytest.approx(total)
            for m in MODELS:
                lo, hi = band(layers[f"{m} weights"], s["t"])
                assert hi - lo == pytest.approx(ms.get(m, {}).get("weight_bytes", 0) / GIB)
                lo, hi = band(layers[f"{m} KV"], s["t"])
                assert hi - lo == pytest.approx(ms.get(m, {}).get("kv_bytes", 0) / GIB)
        total_line = next(ln for ln in ax.get_lines() if ln.get_gid() == f"{p}/total")
        assert list(total_line.get_xdata()) == [s["t"] for s in samples]
    # swap passed nothing: its lowest scale is shown
    assert "0.5" in fig.axes[2].get_title() and "1 req/s" in fig.axes[2].get_title()


def test_ttft_cdfs_at_the_highest_common_scale():
    sweep = make_sweep()
    (ax,) = figure_ttft_cdf(sweep).axes
    assert ax.get_xscale() == "log"
    lines = lines_by_label(ax)
    assert set(POLICIES) <= set(lines)
    for p in POLICIES:  # scale 2 is the highest all three ran
        reqs = run_at(sweep, p, 2.0)["requests"]
        finite = sorted(r["ttft_s"] for r in reqs if r["ttft_s"] is not None)
        assert list(lines[p].get_xdata()) == finite
        n = len(reqs)
        last = (n - 1) / n if p == "swap" else 1.0
        assert lines[p].get_ydata()[-1] == pytest.approx(last)
    slo = next(ln for ln in ax.get_lines() if ln.get_gid() == "ttft_slo")
    assert list(slo.get_xdata()) == [0.5, 0.5]
    # models with different TTFT SLOs: no SLO line
    sweep["config"]["slos"]["c"]["ttft_s"] = 1.0
    (ax,) = figure_ttft_cdf(sweep).axes
    assert not any(ln.get_gid() == "ttft_slo" for ln in ax.get_lines())


def test_ttft_cdfs_fall_back_to_showcase_runs_without_a_common_scale():
    sweep = make_sweep()
    pols = sweep["policies"]
    pols["static"]["runs"] = [r for r in pols["static"]["runs"] if r["scale"] == 1.0]
    pols["swap"]["runs"] = [r for r in pols["swap"]["runs"] if r["scale"] == 0.5]
    (ax,) = figure_ttft_cdf(sweep).axes
    lines = lines_by_label(ax)
    for p, scale in (("prism", 2.0), ("static", 1.0), ("swap", 0.5)):
        reqs = run_at(sweep, p, scale)["requests"]
        assert list(lines[p].get_xdata()) == sorted(r["ttft_s"] for r in reqs)


def test_plot_sweep_writes_pngs(tmp_path: Path):
    paths = plot_sweep(make_sweep(), tmp_path / "plots")
    assert set(paths) == {"attainment", "memory", "ttft_cdf", "residency"}
    for name, path in paths.items():
        assert path == tmp_path / "plots" / f"{name}.png"
        data = path.read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_SIGNATURE
    ihdr = paths["attainment"].read_bytes()[16:24]  # 8 x 5 in at 110 dpi
    assert (int.from_bytes(ihdr[:4], "big"), int.from_bytes(ihdr[4:], "big")) == (880, 550)


def test_plot_sweep_survives_empty_policies(tmp_path: Path):
    sweep = make_sweep()
    sweep["policies"]["swap"] = {"sustained_scale": None, "sustained_rate_rps": None, "runs": []}
    sweep["policies"]["static"]["runs"][0]["samples"] = []
    paths = plot_sweep(sweep, tmp_path)
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in paths.values())
    (ax,) = figure_ttft_cdf(sweep).axes
    assert len(lines_by_label(ax)["swap"].get_xdata()) == 0


def test_plots_import_nothing_of_the_engine_and_need_matplotlib_to_import():
    code = (
        "import sys, prism_server.bench\n"
        "assert 'matplotlib' not in sys.modules\n"
        "from prism_server.bench import plots\n"
        "plots.figure_attainment({'config': {}, 'policies': {}})\n"
        "bad = [m for m in sys.modules if m in ('torch', 'matplotlib.pyplot')\n"
        "       or m.startswith(('prism_server.engine', 'kvpool', 'models'))]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
    # without matplotlib the import itself fails, which the sweep catches to skip its plots
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "try:\n"
        "    import prism_server.bench.plots\n"
        "except ImportError:\n"
        "    sys.exit(0)\n"
        "sys.exit('imported without matplotlib')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
