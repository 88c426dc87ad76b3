"""The sweep: for each policy, start a server (its own process, the same config but the policy),
replay the workload at rising rate scales while sampling its status, find the highest scale that
keeps the target joint SLO attainment (99%), stop the server; then one JSON (every request of
every run, the status samples, the residency timelines), one markdown table and the plots.

The policies may be swept in separate invocations into the same directory (one per device call,
say): each merges its policy into the directory's sweep.json and reuses its SLOs.

SLOs: k x each model's standalone p99, given per model, or fixed (the same for every model).
Each server writes a request log (`--request-log`) that every run joins by response id: each
request's waits and preemptions, each missed request's cause (causes.py). One run, its replay
and its record, is sweep_run.py's; the table, sweep_table.py's. The static policy may
serve only part of the fleet (`static_subset`, fleet.py): the busiest models that fit its pool,
with a config that holds only them and their rows of the workload.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

from prism_server.bench.fleet import (
    block_sizes,
    derive_config,
    fetch_fleet,
    kv_budget_set,
    model_names,
    pick_subset,
    rows_of,
)
from prism_server.bench.server_process import ServerProcess, wait_quiet
from prism_server.bench.standalone import slos_from, standalone
from prism_server.bench.sweep_run import run_once
from prism_server.bench.sweep_table import ratios, table
from prism_server.bench.workload import Row

log = logging.getLogger(__name__)


@dataclass
class SweepConfig:
    workload: str  # the CSV replayed
    out: str  # the directory written
    policies: Sequence[str] = ("prism", "static", "swap")
    scales: Sequence[float] = (1.0, 2.0, 4.0)
    target: float = 0.99  # joint (TTFT and TPOT) attainment a scale must keep
    server_config: str | None = None  # TOML for python -m prism_server (the same for all)
    server_args: Sequence[str] = ()  # more flags for it
    slos: dict[str, dict] | None = None  # model -> {"ttft_s", "tpot_s"}; None: standalone x k
    # the same (TTFT s, TPOT s) for every model (then `slos` holds them per model)
    fixed_slo: tuple[float, float] | None = None
    k: float = 5.0
    standalone_requests: int = 10
    standalone_max_output: int = 64
    refine: int = 0  # bisection steps between the last passing and the first failing scale
    keep_going: int = 0  # scales still tried after the first failing one
    sample_interval_s: float = 0.25
    startup_timeout_s: float = 900.0
    settle_s: float = 1.0  # quiet time between runs
    api_key: str | None = None
    plots: bool = True
    # the servers are told the SLOs (--slo-file), as an operator configures them: the prism
    # policy's arbitrator schedules to the deadlines the bench measures (the baselines ignore
    # them); False: servers derive their own per-request deadlines
    server_slos: bool = True
    # wall-clock seconds the whole invocation may take (None: no limit): a run that would end
    # past it is not started, so a sweep under a time limit keeps what it measured
    budget_s: float | None = None
    # end a run as soon as more requests have missed their SLOs than the target allows: the
    # run fails whatever comes after (its attainment is then only bounded from above)
    stop_early: bool = False
    # the static policy on part of the fleet (it cannot hold all of it): "auto" (the busiest
    # models that fit its pool, sized by a server of the full config) or the models' names;
    # None: the whole config
    static_subset: str | Sequence[str] | None = None
    # each server writes a line per request (--request-log) that the runs join for miss causes
    request_log: bool = True
    extra: dict = field(default_factory=dict)  # recorded as is (the machine, the command)


def passed(run: dict, target: float) -> bool:
    a = run["report"]["overall"]["attainment"]
    return a is not None and a >= target


def sustained(runs: Sequence[dict], target: float) -> dict | None:
    """The highest-scale run below every failing scale that kept the target (None: none did)."""
    best = None
    for run in sorted(runs, key=lambda r: r["scale"]):
        if not passed(run, target):
            break
        best = run
    return best


def _next_scale(runs: Sequence[dict], target: float) -> float | None:
    """Bisection (geometric) between the sustained scale and the lowest failing one above it."""
    best = sustained(runs, target)
    fails = [r["scale"] for r in runs if not passed(r, target)]
    if not fails:
        return None
    hi = min(f for f in fails if best is None or f > best["scale"])
    lo = best["scale"] if best else None
    mid = math.sqrt(lo * hi) if lo else hi / 2
    if lo is not None and hi / lo < 1.05:
        return None
    return mid


async def sweep_policy(
    cfg: SweepConfig,
    policy: str,
    rows: Sequence[Row],
    out: Path,
    slos,
    deadline: float | None = None,
    progress=None,
    earlier: Sequence[dict] = (),
    tag: str | None = None,
):
    """Starts the server under `policy`, measures the SLOs (standalone) if none are set yet, runs
    every scale (none that would end past `deadline`, time.monotonic()); returns (policy entry,
    slos, standalone figures or None). progress(entry, slos, standalone) after each run.
    earlier: this policy's runs from a previous sweep under the same SLOs; they stay in the
    entry (a scale run again replaces its earlier run). tag: names the server's files in `out`
    (server-<tag>.log, requests-<tag>.jsonl; default the policy's name). The entry records the
    pool and the models' sizes the server reported (`fleet`)."""
    tag = tag or policy
    base_rate = len(rows) / max(rows[-1].arrival_s, 1e-9)
    alone = None
    if slos is None:  # measured on a server of its own, which knows no SLOs yet
        alone = await measure_standalone(cfg, policy, rows, out / f"server-{tag}-standalone.log")
        slos = slos_from(alone, cfg.k)
        log.info("standalone SLOs (k = %g): %s", cfg.k, slos)
    slo_file = None
    if cfg.server_slos:  # the models this server serves (it refuses SLOs of others)
        served = {r.model for r in rows}
        slo_file = out / ("slos.json" if tag == policy else f"slos-{tag}.json")
        slo_file.write_text(json.dumps({"slos": {m: s for m, s in slos.items() if m in served}}))
    request_log = out / f"requests-{tag}.jsonl" if cfg.request_log else None
    server = ServerProcess(cfg, policy, out / f"server-{tag}.log", slo_file, request_log)
    server.start()
    try:
        t_start = time.monotonic()
        await server.ready(cfg.startup_timeout_s)
        startup_s = time.monotonic() - t_start
        log.info("%s: server ready in %.1f s", tag, startup_s)
        runs: list[dict] = list(earlier)
        entry = {"startup_s": startup_s, "server_exit": None, "stopped": None, "runs": runs}
        try:
            entry["fleet"] = await fetch_fleet(server.url, cfg.api_key)
        except (ValueError, KeyError, aiohttp.ClientError) as e:  # several devices, say
            log.info("%s: no fleet sizes (%s)", tag, e)

        async def one(scale: float) -> dict | None:
            """Runs `scale` unless it would end past the deadline; None if not run."""
            expected = expected_run_s(rows[-1].arrival_s, scale, runs)
            if deadline is not None and time.monotonic() + cfg.settle_s + expected > deadline:
                entry["stopped"] = f"time budget: x{scale:g} not run"
                log.warning("%s: %s", policy, entry["stopped"])
                return None
            await wait_quiet(server.url, cfg.api_key, cfg.settle_s)
            run = await run_once(
                server.url,
                rows,
                slos,
                scale,
                base_rate,
                cfg.sample_interval_s,
                cfg.api_key,
                stop_below=cfg.target if cfg.stop_early else None,
                request_log=request_log,
            )
            runs[:] = [r for r in runs if r["scale"] != scale] + [run]
            _log_run(tag, run)
            _summarise(entry, cfg.target)
            if progress is not None:
                progress(entry, slos, alone)
            return run

        fails = 0
        for scale in sorted(cfg.scales):
            run = await one(scale)
            if run is None:
                break
            if not passed(run, cfg.target):
                fails += 1
                if fails > cfg.keep_going:
                    break
        for _ in range(cfg.refine):
            scale = _next_scale(runs, cfg.target)
            if scale is None or await one(scale) is None:
                break
    finally:
        rc = await asyncio.to_thread(server.stop)
    entry["server_exit"] = rc
    _summarise(entry, cfg.target)
    return entry, slos, alone


async def measure_standalone(cfg: SweepConfig, policy: str, rows: Sequence[Row], log_path: Path):
    """Each model of `rows` alone on a server of its own (which knows no SLOs yet)."""
    probe = ServerProcess(cfg, policy, log_path)
    probe.start()
    try:
        await probe.ready(cfg.startup_timeout_s)
        return await standalone(
            probe.url, rows, cfg.standalone_requests, cfg.api_key, cfg.standalone_max_output
        )
    finally:
        await asyncio.to_thread(probe.stop)


async def probe_fleet(cfg: SweepConfig, out: Path) -> dict:
    """The pool and the models' sizes, from a server of the full config under prism (which
    loads every model, offloading what does not fit)."""
    probe = ServerProcess(cfg, "prism", out / "server-fleet.log")
    probe.start()
    try:
        await probe.ready(cfg.startup_timeout_s)
        return await fetch_fleet(probe.url, cfg.api_key)
    finally:
        await asyncio.to_thread(probe.stop)


def expected_run_s(span_s: float, scale: float, runs: list[dict]) -> float:
    """How long a run at `scale` should take: the arrivals' span at that scale (span_s at x1),
    plus the longest drain (the time past the last arrival) of the runs so far, plus 10 s."""
    drain = max((r["duration_s"] - span_s / r["scale"] for r in runs), default=0.0)
    return span_s / scale + max(drain, 0.0) + 10


def _summarise(entry: dict, target: float) -> None:
    entry["runs"].sort(key=lambda r: r["scale"])
    best = sustained(entry["runs"], target)
    entry["sustained_scale"] = best["scale"] if best else None
    entry["sustained_rate_rps"] = best["rate_rps"] if best else None


def _log_run(policy: str, run: dict) -> None:
    o = run["report"]["overall"]
    log.info(
        "%s x%g (%.2f req/s): attainment %.1f%% (TTFT %.1f%%, TPOT %.1f%%), errors %d, "
        "activations %d, evictions %d",
        policy,
        run["scale"],
        run["rate_rps"],
        100 * (o["attainment"] or 0),
        100 * (o["ttft_attainment"] or 0),
        100 * (o["tpot_attainment"] or 0),
        o["errors"],
        run["activations"],
        run["evictions"],
    )
    if run.get("stopped_early"):
        st = run["stopped_early"]
        log.info(
            "%s x%g: stopped at %.1f s, %d requests missed (%d of %d sent): attainment <= %.1f%%",
            policy,
            run["scale"],
            st["at_s"],
            st["missed"],
            st["sent"],
            len(run["requests"]),
            100 * st["attainment_at_most"],
        )


def load_sweep(out: Path) -> dict | None:
    """A sweep directory's sweep.json (or, archived, sweep.json.gz); None when it has neither."""
    path = out / "sweep.json"
    if path.exists():
        return json.loads(path.read_text())
    packed = out / "sweep.json.gz"
    return json.loads(gzip.decompress(packed.read_bytes())) if packed.exists() else None


def slo_source(cfg: SweepConfig) -> str:
    """How the sweep's SLOs were set, as its table says."""
    if cfg.fixed_slo:
        ttft, tpot = cfg.fixed_slo
        return f"fixed: TTFT {ttft:g} s, TPOT {tpot:g} s for every model"
    return "given" if cfg.slos else f"standalone x {cfg.k:g}"


async def static_subset(
    cfg: SweepConfig, rows: Sequence[Row], out: Path, known: dict, drop: Sequence[str] = ()
) -> dict:
    """The models the static policy serves and the config that holds only them (written into
    `out`): cfg.static_subset's names, or ("auto") the busiest that fit the pool, sized by a
    server of the full config (`known`: a policy entry's recorded fleet, else a probe), less
    the models in `drop`."""
    if not cfg.server_config:
        raise ValueError("a static subset is cut from the config: give --config")
    names = model_names(cfg.server_config)
    fleet = known.get("fleet")
    need_pool = kv_budget_set(cfg.server_config)
    if fleet is None and (cfg.static_subset == "auto" or need_pool):
        fleet = await probe_fleet(cfg, out)
    if cfg.static_subset == "auto":
        models = pick_subset(fleet, rows, names, block_sizes(cfg.server_config))
        models = [m for m in models if m not in set(drop)]
        if not models:
            raise ValueError("no model fits the pool with its minimal KV: no static subset")
    else:
        models = [m for m in names if m in set(cfg.static_subset)]
        unknown = sorted(set(cfg.static_subset) - set(names))
        if unknown:
            raise ValueError(f"--static-subset: the config has no models {unknown}")
    path = derive_config(
        cfg.server_config, models, out / "static-subset.toml", fleet and fleet["pool_bytes"]
    )
    log.info("static on %d of %d models: %s (%s)", len(models), len(names), models, path.name)
    return {
        "models": models,
        "of": len(names),
        "how": "auto" if cfg.static_subset == "auto" else "given",
        "config": str(path),
        "requests": len(rows_of(rows, models)),
    }


async def run_sweep(cfg: SweepConfig, rows: Sequence[Row]) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep = load_sweep(out) or {"policies": {}}
    slos = cfg.slos or sweep.get("config", {}).get("slos")
    alone = sweep.get("standalone")
    deadline = time.monotonic() + cfg.budget_s if cfg.budget_s else None

    def merge(policy: str, entry: dict, slos, measured, plots: bool, subset=None) -> None:
        if subset is not None:
            entry["subset"] = subset
        sweep["policies"][policy] = entry
        config = asdict(cfg)
        del config["api_key"]  # never written to disk
        sweep["config"] = {
            **config,
            "slos": slos,
            "slo_source": sweep.get("config", {}).get("slo_source")
            if not cfg.slos and not measured and sweep.get("config")
            else slo_source(cfg),
            "models": sorted({r.model for r in rows}),
            "requests": len(rows),
            "span_s": rows[-1].arrival_s,
            "base_rate_rps": len(rows) / max(rows[-1].arrival_s, 1e-9),
        }
        sweep["standalone"] = measured or alone
        order = [p for p in ("prism", "static", "swap") if p in sweep["policies"]]
        order += [p for p in sweep["policies"] if p not in order]
        sweep["policies"] = {p: sweep["policies"][p] for p in order}
        sweep["ratios"] = ratios(sweep["policies"], sweep["config"]["target"], slos)
        write(sweep, out, plots)

    policies = list(cfg.policies)
    if cfg.static_subset and slos is None and "static" in policies[:-1]:
        policies.remove("static")  # the SLOs are measured on the whole fleet first
        policies.append("static")
    for policy in policies:
        prows, pcfg, subset, known = rows, cfg, None, {}
        before = sweep["policies"].get(policy, {})
        if policy == "static" and cfg.static_subset:
            full = [p for p in sweep["policies"].values() if p.get("fleet") and not p.get("subset")]
            known = full[0] if full else {}
            subset = await static_subset(cfg, rows, out, known)
            prows = rows_of(rows, subset["models"])
            pcfg = replace(cfg, server_config=subset["config"])
        same_slos = slos is not None and slos == sweep.get("config", {}).get("slos")
        same_models = (before.get("subset") or {}).get("models") == (subset or {}).get("models")
        earlier = before.get("runs", []) if same_slos and same_models else []
        dropped: list[str] = []
        while True:
            try:
                entry, slos, measured = await sweep_policy(
                    pcfg,
                    policy,
                    prows,
                    out,
                    slos,
                    deadline,
                    # after each run: a sweep cut short keeps what it measured (plots at the end)
                    progress=lambda e, s, a, p=policy, sub=subset: merge(p, e, s, a, False, sub),
                    earlier=earlier,
                )
                break
            except RuntimeError as e:  # sizes that were estimated (offloaded models) fell short
                short = "MemoryError" in str(e) or "out of memory" in str(e).lower()
                if not (short and subset and subset["how"] == "auto" and len(subset["models"]) > 1):
                    raise
                counts = {m: sum(r.model == m for r in prows) for m in subset["models"]}
                dropped.append(min(subset["models"], key=lambda m: (counts[m], m)))
                log.warning("static did not start on %s; without %s", subset["models"], dropped[-1])
                subset = await static_subset(cfg, rows, out, known, dropped)
                prows = rows_of(rows, subset["models"])
                pcfg, earlier = replace(cfg, server_config=subset["config"]), []
        alone = measured or alone
        merge(policy, entry, slos, measured, cfg.plots, subset)
    return sweep


def write(sweep: dict, out: Path, plots: bool = True) -> list[Path]:
    (out / "sweep.json").write_text(json.dumps(sweep))
    (out / "sweep.md").write_text(table(sweep) + "\n")
    written = [out / "sweep.json", out / "sweep.md"]
    if plots:
        try:
            from prism_server.bench.plots import plot_sweep
        except ImportError as e:  # matplotlib absent (a bare GPU box): plot later with `plot`
            log.warning("no plots (%s); run `python -m prism_server bench plot %s`", e, out)
        else:
            written += list(plot_sweep(sweep, out).values())
    return written
