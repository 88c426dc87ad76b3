"""Models per GPU at the target attainment: for each policy, serve the config's first n models
(config order) for n = start, start + step, ... (the last n being all of them), replay their
rows of the workload (each model its own stream, so its own rate profile) once at one rate
scale, and stop at the first n whose joint SLO attainment falls below the target. The policy's
capacity is the largest n below every failing one. A server that cannot start with n models
(static cannot hold them all) fails that n.

Each n's server gets a derived config (the [[models]] tables of the first n models, the rest of
the config as it was) written into the output directory, with its own request log; capacity.json
holds every run's record (as a sweep's), capacity.md the table and capacity.png the plot.

The policies may run in separate invocations into the same directory (one per device call):
each keeps the other policies' results when the SLOs, the scale, the models and the counts are
the same, and reuses the SLOs measured before.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from prism_server.bench.fleet import derive_config, kv_budget_set, model_names, rows_of
from prism_server.bench.standalone import slos_from
from prism_server.bench.sweep import (
    SweepConfig,
    measure_standalone,
    passed,
    slo_source,
    sweep_policy,
)
from prism_server.bench.sweep_table import busy_cell, causes_cell
from prism_server.bench.workload import Row

log = logging.getLogger(__name__)


def model_counts(total: int, start: int, step: int) -> list[int]:
    """start, start + step, ... up to total, and total itself last."""
    if start < 1 or step < 1:
        raise ValueError("--start and --step must be at least 1")
    if start > total:
        raise ValueError(f"--start {start}: the config has only {total} models")
    ns = list(range(start, total + 1, step))
    return ns if ns[-1] == total else [*ns, total]


def capacity_of(points: Sequence[dict], target: float) -> int | None:
    """The largest n below every failing one (points in rising n, each with its `attainment`,
    None when its run did not happen or stopped early); None: the first n failed."""
    best = None
    for p in sorted(points, key=lambda p: p["n"]):
        if p.get("attainment") is None or p["attainment"] < target:
            break
        best = p["n"]
    return best


def _point(n: int, models: Sequence[str], run: dict | None, target: float, **extra) -> dict:
    att = None
    if run is not None and not run.get("stopped_early"):
        att = run["report"]["overall"]["attainment"]
    return {
        "n": n,
        "models": list(models),
        "attainment": att,
        "passed": run is not None and passed(run, target),
        "run": run,
        **extra,
    }


async def run_capacity(
    cfg: SweepConfig, rows: Sequence[Row], scale: float = 1.0, start: int = 1, step: int = 1
) -> dict:
    """Every policy of cfg over rising model counts; writes and returns capacity.json's dict."""
    if not cfg.server_config:
        raise ValueError("the capacity sweep serves the config's first n models: give --config")
    if kv_budget_set(cfg.server_config):
        raise ValueError(
            f"{cfg.server_config} sizes its pool by kv_budget_bytes (beside the weights of every "
            "model), so it would grow with n: set pool_budget_bytes (or neither) in [engine]"
        )
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    names = model_names(cfg.server_config)
    rows = rows_of(rows, names)
    if not rows:
        raise ValueError("the workload has no rows for the config's models")
    counts = model_counts(len(names), start, step)
    deadline = time.monotonic() + cfg.budget_s if cfg.budget_s else None
    old = load(out)
    slos, alone, source = cfg.slos, None, slo_source(cfg)
    if slos is None and old:  # the SLOs an earlier invocation measured
        slos, alone, source = old["config"]["slos"], old["standalone"], old["config"]["slo_source"]
    if slos is None:  # each model alone on a server of the whole config
        alone = await measure_standalone(cfg, "prism", rows, out / "server-standalone.log")
        slos = slos_from(alone, cfg.k)
    config = asdict(cfg)
    del config["api_key"]  # never written to disk
    result = {
        "config": {
            **config,
            "scale": scale,
            "start": start,
            "step": step,
            "counts": counts,
            "models": names,
            "slos": slos,
            "slo_source": source,
        },
        "standalone": alone,
        "policies": {},
    }
    same = old and all(
        old["config"].get(k) == result["config"][k]
        for k in ("slos", "scale", "models", "counts", "target", "workload")
    )
    kept = {p: e for p, e in (old["policies"] if same else {}).items() if p not in cfg.policies}
    result["policies"].update(kept)
    for policy in cfg.policies:
        entry = {"capacity": None, "stopped": None, "points": []}
        result["policies"][policy] = entry
        for n in counts:
            models = names[:n]
            sub = rows_of(rows, models)
            path = derive_config(cfg.server_config, models, out / f"config-n{n}.toml")
            pcfg = replace(cfg, server_config=str(path), scales=[scale], refine=0, keep_going=0)
            tag = f"{policy}-n{n}"
            try:
                e, _, _ = await sweep_policy(pcfg, policy, sub, out, slos, deadline, tag=tag)
            except RuntimeError as err:  # the server did not start: it cannot hold n models
                said = [x.strip() for x in str(err).splitlines() if x.strip()]
                why = said[-1] if said else "the server did not start"  # the log's last line
                log.warning("%s with %d models: %s", policy, n, why)
                entry["points"].append(_point(n, models, None, cfg.target, error=why))
                break
            if not e["runs"]:  # the time budget
                entry["stopped"] = e["stopped"]
                break
            point = _point(n, models, e["runs"][0], cfg.target, requests=len(sub))
            entry["points"].append(point)
            entry["capacity"] = capacity_of(entry["points"], cfg.target)
            write(result, out, plots=False)
            if not point["passed"]:
                break
        entry["capacity"] = capacity_of(entry["points"], cfg.target)
        write(result, out, plots=False)
    write(result, out, cfg.plots)
    return result


def table(cap: dict) -> str:
    """One row per policy: the models it serves at the target, its attainment at each n, the
    activations / evictions and the missed requests' causes of each n's run."""
    cfg = cap["config"]
    target, total = cfg["target"], len(cfg["models"])
    lines = [
        f"Models per GPU at {100 * target:g}% joint SLO attainment (SLOs {cfg['slo_source']}), "
        f"each run at x{cfg['scale']:g} the workload's rate of its models; models added in "
        "config order.\n",
        f"| policy | models at {100 * target:g}% (of {total}) | attainment per n "
        "| activations / evictions per n | missed: causes per n | preemptions per n "
        "| engine busy per n |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in cap["policies"].items():
        pts = e["points"]
        got = e["capacity"]
        first = pts[0]["n"] if pts else cfg["start"]
        kept = str(got) if got is not None else f"< {first}"
        if e.get("stopped"):
            kept += f" ({e['stopped']})"
        att, moves, causes, pre, busy = [], [], [], [], []
        for p in pts:
            run = p["run"]
            if run is None:
                att.append(f"n={p['n']}: did not start")
                continue
            a = (
                f"<= {100 * run['stopped_early']['attainment_at_most']:.1f}% (stopped)"
                if run.get("stopped_early")
                else f"{100 * p['attainment']:.1f}%"
            )
            att.append(f"n={p['n']}: {a}")
            moves.append(f"n={p['n']}: {run['activations']} / {run['evictions']}")
            if run.get("miss_causes"):
                causes.append(f"n={p['n']}: {causes_cell(run)}")
            if "preemptions" in run:
                pre.append(f"n={p['n']}: {run['preemptions']}")
            if run.get("engine"):
                busy.append(f"n={p['n']}: {busy_cell(run)}")
        cells = [", ".join(x) or "-" for x in (att, moves)]
        cells += ["; ".join(causes) or "none", ", ".join(pre) or "-", ", ".join(busy) or "-"]
        lines.append(f"| {name} | {kept} | " + " | ".join(cells) + " |")
    fails = [
        f"{name} with {p['n']} models: {p['error']}"
        for name, e in cap["policies"].items()
        for p in e["points"]
        if p.get("error")
    ]
    if fails:
        lines.append("\nServers that did not start: " + "; ".join(fails) + ".")
    return "\n".join(lines)


def load(out: Path) -> dict | None:
    """The directory's capacity.json (None: none yet)."""
    path = out / "capacity.json"
    return json.loads(path.read_text()) if path.exists() else None


def write(cap: dict, out: Path, plots: bool = True) -> list[Path]:
    order = [p for p in ("prism", "static", "swap") if p in cap["policies"]]
    order += [p for p in cap["policies"] if p not in order]
    cap["policies"] = {p: cap["policies"][p] for p in order}
    (out / "capacity.json").write_text(json.dumps(cap))
    (out / "capacity.md").write_text(table(cap) + "\n")
    written = [out / "capacity.json", out / "capacity.md"]
    if plots:
        try:
            from prism_server.bench.plots import figure_capacity, save
        except ImportError as e:  # matplotlib absent: the table and the JSON still stand
            log.warning("no plot (%s)", e)
        else:
            written.append(save(figure_capacity(cap), out / "capacity.png"))
    return written
