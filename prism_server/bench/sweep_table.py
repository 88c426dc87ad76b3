"""The sweep's markdown: one row per policy (sustained rate, prism's ratio to it, attainment per
scale, moves, activation waits, missed requests by cause, preemptions, the engine's busy time),
then each policy's per-model table at its sustained scale; and the runs' attainment under other
SLOs, from their recorded requests. A policy that served a subset of the fleet is compared with
prism on that subset's requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prism_server.bench.causes import met
from prism_server.bench.report import markdown, showcase_run


def subset_runs(runs: Sequence[dict], models: Sequence[str], slos: Mapping[str, dict]) -> list:
    """(scale, joint attainment) of each run on the requests of `models` only, from its recorded
    requests; None for a run stopped early (it saw only the start of the workload)."""
    keep = set(models)
    out = []
    for run in sorted(runs, key=lambda r: r["scale"]):
        reqs = [r for r in run.get("requests") or [] if r["model"] in keep]
        if run.get("stopped_early") or not reqs:
            out.append((run["scale"], None))
            continue
        ok = [met(r, slos[r["model"]]["ttft_s"], slos[r["model"]]["tpot_s"]) for r in reqs]
        out.append((run["scale"], sum(ok) / len(ok)))
    return out


def _sustained_scale(points: Sequence[tuple[float, float | None]], target: float):
    best = None
    for scale, att in points:
        if att is None or att < target:
            break
        best = scale
    return best


def ratios(
    policies: dict[str, dict],
    target: float = 0.99,
    slos: Mapping[str, dict] | None = None,
    ref: str = "prism",
) -> dict[str, dict]:
    """ref's sustained rate over each other policy's: a number when both sustained one; a lower
    bound (`at_least`) when the other sustained none of the scales tried. A policy that served a
    subset of the fleet (its entry's `subset`) is compared on that subset: ref's attainment on
    the subset's requests of its own runs (the same scales, under `slos`), its sustained rate on
    them against the policy's."""
    out = {}
    for name, p in policies.items():
        mine = policies.get(ref, {}).get("sustained_rate_rps")
        if name == ref or not p.get("runs"):
            continue
        extra = {}
        sub = p.get("subset")
        if sub and slos and policies.get(ref, {}).get("runs"):
            points = subset_runs(policies[ref]["runs"], sub["models"], slos)
            scale = _sustained_scale(points, target)
            run = p["runs"][0]
            mine = scale * run["rate_rps"] / run["scale"] if scale is not None else None
            extra = {"on_subset": True, "ref_scale": scale, "ref_attainment": points}
        if mine is None:
            continue
        theirs = p.get("sustained_rate_rps")
        if theirs:
            out[f"{ref}/{name}"] = {"ratio": mine / theirs, **extra}
        else:
            lowest = min(r["rate_rps"] for r in p["runs"])
            out[f"{ref}/{name}"] = {"ratio": None, "at_least": mine / lowest, **extra}
    return out


def table(sweep: dict) -> str:
    """The sweep's markdown: one row per policy, then each policy's per-model table at its
    sustained scale."""
    cfg = sweep["config"]
    target = cfg["target"]
    rat = sweep.get("ratios", {})
    source = cfg.get("slo_source") or "given"
    lines = [
        f"| policy | sustained rate req/s (scale) at {100 * target:g}%, SLOs {source} "
        "| prism ÷ policy | attainment per scale | activations / evictions | waited for "
        "activation: requests, TTFT p99 s | missed: causes | preemptions / recomputed tokens "
        "| engine busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, p in sweep["policies"].items():
        rate = (
            f"{p['sustained_rate_rps']:.3f} (x{p['sustained_scale']:g})"
            if p["sustained_scale"] is not None
            else "none"
        )
        sub = p.get("subset")
        if sub:
            rate += f" on {len(sub['models'])} of {sub['of']} models (subset: "
            rate += ", ".join(sub["models"]) + ")"
        r = rat.get(f"prism/{name}")
        ratio = "1" if name == "prism" else "-"
        if r and r["ratio"] is not None:
            ratio = f"{r['ratio']:.2f}"
        elif r:
            ratio = f"> {r['at_least']:.2f}"
        if r and r.get("on_subset"):
            ratio += " on the subset"
            notes.append(
                f"{name} served {len(sub['models'])} of the {sub['of']} models (the rest do not "
                f"fit its pool) and replayed only their requests; prism ÷ {name} is prism's "
                "sustained rate on the same requests (its attainment on them in its own runs: "
                + ", ".join(
                    f"x{x:g}: {'-' if a is None else f'{100 * a:.1f}%'}"
                    for x, a in r["ref_attainment"]
                )
                + f") over {name}'s."
            )
        per_scale = ", ".join(f"x{x['scale']:g}: {_attainment(x)}" for x in p["runs"])
        shown = showcase_run(p)
        moves = f"{shown['activations']} / {shown['evictions']}" if shown else "-"
        aw = shown["activation_wait"] if shown else None
        waited = (
            f"{aw['requests']}, {aw['ttft_p99_s']:.3f}"
            if aw and aw["ttft_p99_s"] is not None
            else "0, -"
        )
        lines.append(
            f"| {name} | {rate} | {ratio} | {per_scale} | {moves} | {waited} | "
            f"{causes_cell(shown)} | {_preemptions(shown)} | {busy_cell(shown)} |"
        )
    out = ["\n".join(lines)]
    if notes:
        out.append("\n" + "\n".join(notes))
    for name, p in sweep["policies"].items():
        shown = showcase_run(p)
        if shown:
            which = (
                "sustained"
                if p["sustained_scale"] is not None
                else "lowest run to the end, not sustained"
                if not shown.get("stopped_early")
                else "lowest, not sustained, stopped early"
            )
            head = f"\n**{name}** at x{shown['scale']:g} ({which}):\n\n"
            out.append(head + markdown(shown["report"]) + _engine_line(shown.get("engine")))
    return "\n".join(out)


def slo_table(sweep: dict, slos: Mapping[str, dict], label: str) -> str:
    """Each policy's runs under other SLOs (`label` names them), from their recorded requests,
    beside the attainment under the sweep's own; a run stopped early has no figure under them."""
    cfg = sweep["config"]
    target = cfg["target"]
    lines = [
        f"SLOs {label} (the sweep's headline: {cfg.get('slo_source') or 'given'}); "
        f"sustained: the highest scale below every one under {100 * target:g}%.\n",
        f"| policy | attainment per scale, headline SLOs | attainment per scale, SLOs {label} "
        "| sustained rate req/s (scale) under them |",
        "|---|---|---|---|",
    ]
    for name, p in sweep["policies"].items():
        models = sorted({r["model"] for x in p["runs"] for r in x["requests"]})
        missing = sorted(set(models) - set(slos))
        if missing:
            raise ValueError(f"no SLO for models {missing}")
        points = subset_runs(p["runs"], models, slos)
        scale = _sustained_scale(points, target)
        run = next((x for x in p["runs"] if x["scale"] == scale), None)
        rate = f"{run['rate_rps']:.3f} (x{scale:g})" if run else "none"
        head = ", ".join(f"x{x['scale']:g}: {_attainment(x)}" for x in p["runs"])
        alt = ", ".join(f"x{x:g}: {'-' if a is None else f'{100 * a:.1f}%'}" for x, a in points)
        lines.append(f"| {name} | {head} | {alt} | {rate} |")
    return "\n".join(lines)


def causes_cell(run: dict | None) -> str:
    """A run's missed requests by cause, most first ("-": not recorded)."""
    if run is None or "miss_causes" not in run:
        return "-"
    causes = sorted(run["miss_causes"].items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{c} {n}" for c, n in causes) or "none"


def _preemptions(run: dict | None) -> str:
    if run is None or "preemptions" not in run:
        return "-"
    return f"{run['preemptions']} / {run['recomputed_tokens']}"


def busy_cell(run: dict | None) -> str:
    """The engine's busy fraction over the run, per device, and its busy seconds per 1,000
    requests served (GPU-seconds per 1k requests: what serving the workload costs)."""
    eng = (run or {}).get("engine") or {}
    cell = ", ".join(f"{100 * e['busy']:.0f}%" for _, e in sorted(eng.items())) or "-"
    served = ((run or {}).get("report") or {}).get("overall", {}).get("requests")
    busy_s = sum(e.get("step_seconds", 0.0) for e in eng.values())
    if served and busy_s:
        cell += f" ({1000 * busy_s / served:.1f} s / 1k req)"
    return cell


def _attainment(run: dict) -> str:
    """A run's joint attainment; a run stopped early shows its bound and when it stopped."""
    st = run.get("stopped_early")
    if st:
        return (
            f"<= {100 * st['attainment_at_most']:.1f}% (stopped at {st['at_s']:.0f} s, "
            f"{st['missed']} missed)"
        )
    return f"{100 * (run['report']['overall']['attainment'] or 0):.1f}%"


def _engine_line(engine: dict | None) -> str:
    """The engine's share of the run, per device: busy in model steps, and host time between."""
    parts = []
    for dev, e in sorted((engine or {}).items()):
        per = e["host_per_step_s"]
        parts.append(
            f"{dev}: {e['steps']} steps, busy {100 * e['busy']:.1f}% of the time, host between "
            f"steps {100 * e['host']:.1f}%" + (f" ({1e3 * per:.2f} ms a step)" if per else "")
        )
    return "\n\nEngine: " + "; ".join(parts) + "." if parts else ""
