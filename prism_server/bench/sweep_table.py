"""The sweep's markdown: one row per policy (sustained rate, prism's ratio to it, attainment per
scale, moves, activation waits), then each policy's per-model table at its sustained scale."""

from __future__ import annotations

from prism_server.bench.report import markdown, showcase_run


def ratios(policies: dict[str, dict], ref: str = "prism") -> dict[str, dict]:
    """ref's sustained rate over each other policy's: a number when both sustained one; a lower
    bound (`at_least`) when the other sustained none of the scales tried."""
    mine = policies.get(ref, {}).get("sustained_rate_rps")
    out = {}
    for name, p in policies.items():
        if name == ref or mine is None:
            continue
        theirs = p.get("sustained_rate_rps")
        if theirs:
            out[f"{ref}/{name}"] = {"ratio": mine / theirs}
        elif p.get("runs"):
            lowest = min(r["rate_rps"] for r in p["runs"])
            out[f"{ref}/{name}"] = {"ratio": None, "at_least": mine / lowest}
    return out


def table(sweep: dict) -> str:
    """The sweep's markdown: one row per policy, then each policy's per-model table at its
    sustained scale."""
    target = sweep["config"]["target"]
    rat = sweep.get("ratios", {})
    lines = [
        f"| policy | sustained rate req/s (scale) at {100 * target:g}% | prism ÷ policy "
        "| attainment per scale | activations / evictions | waited for activation: "
        "requests, TTFT p99 s |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in sweep["policies"].items():
        rate = (
            f"{p['sustained_rate_rps']:.3f} (x{p['sustained_scale']:g})"
            if p["sustained_scale"] is not None
            else "none"
        )
        r = rat.get(f"prism/{name}")
        ratio = "1" if name == "prism" else "-"
        if r and r["ratio"] is not None:
            ratio = f"{r['ratio']:.2f}"
        elif r:
            ratio = f"> {r['at_least']:.2f}"
        per_scale = ", ".join(f"x{x['scale']:g}: {_attainment(x)}" for x in p["runs"])
        shown = showcase_run(p)
        moves = f"{shown['activations']} / {shown['evictions']}" if shown else "-"
        aw = shown["activation_wait"] if shown else None
        waited = (
            f"{aw['requests']}, {aw['ttft_p99_s']:.3f}"
            if aw and aw["ttft_p99_s"] is not None
            else "0, -"
        )
        lines.append(f"| {name} | {rate} | {ratio} | {per_scale} | {moves} | {waited} |")
    out = ["\n".join(lines)]
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
