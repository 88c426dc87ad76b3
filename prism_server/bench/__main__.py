"""`python -m prism_server bench ...`: the lab test bench, over HTTP only.

bench run         replay a workload against a running server; the per-model table
bench standalone  each model alone at low load: p99 TTFT / TPOT, and SLOs = k x those
bench sweep       per policy: start a server, replay at rising rate scales, find the rate
                  kept at 99% SLO attainment; sweep.json, sweep.md and the plots
bench capacity    per policy: serve the config's first n models for rising n, find the most
                  kept at 99% SLO attainment; capacity.json, capacity.md and the plot
bench report-slo  a sweep's runs under other SLOs, from their recorded requests
bench workload    write a workload CSV from a public trace or the bursty-groups generator
bench plot        the plots of a sweep directory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from prism_server.bench.workload import read_csv, scale_rate


def _workload_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload", required=True, help="CSV: arrival_s, model, prompt_len, output_len"
    )


def _positive(kind: type):
    """An argparse type: a number of `kind` above zero (NaN is not)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number: {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number: {text!r}")
        return v

    return parse


_pos_int, _pos_float = _positive(int), _positive(float)


def _count(text: str) -> int:
    """An argparse type: a whole number, zero or more."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected zero or more: {text!r}")
    return v


def _fraction(text: str) -> float:
    v = _pos_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1]: {text!r}")
    return v


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return vals


def _slo_pair(text: str) -> tuple[float, float]:
    vals = _floats(text)
    if len(vals) != 2:
        raise argparse.ArgumentTypeError(f"expected TTFT_S,TPOT_S (seconds): {text!r}")
    return vals[0], vals[1]


def _slo_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--slo",
        type=_slo_pair,
        metavar="TTFT_S,TPOT_S",
        help="fixed SLOs, the same for every model (e.g. 1.5,0.08; no standalone run)",
    )
    g.add_argument("--slo-file", help="JSON: model -> {ttft_s, tpot_s} (no standalone run)")
    p.add_argument("--k", type=_pos_float, default=5.0, help="SLO = k x standalone p99")
    p.add_argument("--standalone-requests", type=_pos_int, default=10)
    p.add_argument(
        "--standalone-max-output",
        type=_pos_int,
        default=64,
        help="output cap while measuring alone",
    )


def _server_flags(p: argparse.ArgumentParser) -> None:
    """What the servers a sweep starts and its runs share."""
    p.add_argument("--target", type=_fraction, default=0.99, help="joint SLO attainment to keep")
    p.add_argument(
        "--budget-s",
        type=_pos_float,
        help="wall-clock limit: runs that would end past it are skipped",
    )
    p.add_argument(
        "--stop-early",
        action="store_true",
        help="end a run once more requests missed their SLOs than the target allows",
    )
    p.add_argument("--sample-interval", type=_pos_float, default=0.25, help="status poll, seconds")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--settle", type=float, default=1.0, help="quiet seconds between runs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--no-server-slos",
        action="store_true",
        help="do not pass the SLOs to the servers (they derive per-request deadlines)",
    )
    p.add_argument(
        "--no-request-log",
        action="store_true",
        help="start the servers without --request-log (no waits, preemptions or miss causes)",
    )
    p.add_argument("--api-key")
    p.add_argument(
        "--server-arg", action="append", default=[], help="one more server flag (repeatable)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True)

    r = sub.add_parser("run", help="replay a workload against a running server")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="the server to measure")
    _workload_flag(r)
    r.add_argument("--rate-scale", type=_pos_float, default=1.0, help="replay at this x the rate")
    r.add_argument("--ttft-slo-ms", type=_pos_float, default=1000.0)
    r.add_argument("--tpot-slo-ms", type=_pos_float, default=100.0)
    r.add_argument("--slo-file", help="JSON: model -> {ttft_s, tpot_s} (overrides the flags)")
    r.add_argument("--api-key")
    r.add_argument("--json", help="write the report (and every request's record) here")
    r.add_argument("--markdown", help="write the table here")

    s = sub.add_parser("standalone", help="each model alone: p99 TTFT / TPOT and SLOs")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    _workload_flag(s)
    s.add_argument("--requests", type=_pos_int, default=10, help="per model, after a warm-up")
    s.add_argument("--k", type=_pos_float, default=5.0, help="SLO = k x the standalone p99")
    s.add_argument("--max-output", type=_pos_int, default=64, help="output cap while measuring")
    s.add_argument("--api-key")
    s.add_argument("--out", help="write {standalone, slos} JSON here")

    w = sub.add_parser("sweep", help="every policy at rising rate scales")
    _workload_flag(w)
    w.add_argument("--out", required=True, help="directory for sweep.json, sweep.md, plots")
    w.add_argument("--config", help="the server's TOML config (the same for every policy)")
    w.add_argument(
        "--policies", default="prism,static,swap", help="comma-separated (default: all three)"
    )
    w.add_argument("--scales", type=_floats, default=[1.0, 2.0, 4.0], help="e.g. 0.5,1,2,4")
    w.add_argument("--refine", type=_count, default=0, help="bisection steps after the scales")
    w.add_argument("--keep-going", type=_count, default=0, help="scales tried after a failure")
    w.add_argument(
        "--static-subset",
        help="static serves part of the fleet: `auto` (the busiest models that fit its pool, "
        "sized by a server of the whole config) or model names, comma-separated",
    )
    _slo_flags(w)
    _server_flags(w)

    c = sub.add_parser("capacity", help="every policy over rising numbers of models")
    _workload_flag(c)
    c.add_argument("--config", required=True, help="the fleet's TOML; models added in its order")
    c.add_argument("--out", required=True, help="directory for capacity.json, .md, .png")
    c.add_argument(
        "--policies", default="prism,static,swap", help="comma-separated (default: all three)"
    )
    c.add_argument("--scale", type=_pos_float, default=1.0, help="each run at this x the rate")
    c.add_argument("--start", type=_pos_int, default=1, help="the first number of models")
    c.add_argument("--step", type=_pos_int, default=1, help="models added each time")
    _slo_flags(c)
    _server_flags(c)

    rs = sub.add_parser("report-slo", help="a sweep's runs under other SLOs")
    rs.add_argument("dir", help="the sweep's directory (its sweep.json)")
    g = rs.add_mutually_exclusive_group(required=True)
    g.add_argument("--slo", type=_slo_pair, metavar="TTFT_S,TPOT_S", help="the same for all")
    g.add_argument("--slo-file", help="JSON: model -> {ttft_s, tpot_s}")
    rs.add_argument("--markdown", help="write the table here")

    pl = sub.add_parser("plot", help="the plots of a sweep directory")
    pl.add_argument("dir")

    sm = sub.add_parser(
        "simulate", help="a sweep's runs replayed in the device simulator with measured step costs"
    )
    sm.add_argument("dir", help="the sweep's directory (its sweep.json)")
    sm.add_argument("--workload", help="the CSV replayed (default: the sweep's own)")
    sm.add_argument("--policy", default="prism", choices=["prism", "static"])
    sm.add_argument("--scales", type=_floats, default=[], help="more scales to predict")
    sm.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sm.add_argument(
        "--step-trace",
        help="a run's step trace (serve --step-trace; .gz or not): the step costs fitted to all "
        "of its steps replace the runs' recorded online fits",
    )
    sm.add_argument(
        "--noise-seeds",
        type=int,
        default=0,
        help="with --step-trace: each step lasts its fit times a ratio drawn from the trace; "
        "every prediction the mean (and worst) over this many seeds",
    )

    from prism_server.bench.traces_cli import add_workload_command

    add_workload_command(sub)


def _slo_file(path: str) -> dict[str, dict]:
    """{model: {ttft_s, tpot_s}} (or that under "slos"), each a positive number of seconds."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    data = data.get("slos", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of model -> {{ttft_s, tpot_s}}")
    for model, s in data.items():
        ok = isinstance(s, dict) and all(
            isinstance(s.get(k), (int, float)) and s[k] > 0 for k in ("ttft_s", "tpot_s")
        )
        if not ok:
            raise ValueError(f"{path}: {model} needs ttft_s and tpot_s, positive seconds")
    return data


def _rows(path: str):
    rows = read_csv(path)
    if not rows:
        raise ValueError(f"{path}: the workload has no rows")
    return rows


def _run(args) -> int:
    from prism_server.bench.replay import replay
    from prism_server.bench.report import markdown, report
    from prism_server.bench.sweep_run import _record

    rows = scale_rate(_rows(args.workload), args.rate_scale)
    if args.slo_file:
        given = _slo_file(args.slo_file)
        slos = {m: (given[m]["ttft_s"], given[m]["tpot_s"]) for m in {r.model for r in rows}}
    else:
        slos = {r.model: (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3) for r in rows}
    results = asyncio.run(replay(args.url, rows, args.api_key))
    rep = report(results, slos, rows[-1].arrival_s or 1.0)
    table = markdown(rep)
    print(table)
    if args.json:
        rep["requests"] = [_record(r) | {"gaps_s": r.gaps} for r in results]
        Path(args.json).write_text(json.dumps(rep, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    failed = [r.error for r in results if r.error is not None]
    if results and len(failed) == len(results):  # no measurement: say why, and fail
        print(f"error: every request failed, the first with: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def _standalone(args) -> int:
    from prism_server.bench.standalone import slos_from, standalone

    alone = asyncio.run(
        standalone(args.url, _rows(args.workload), args.requests, args.api_key, args.max_output)
    )
    slos = slos_from(alone, args.k)
    for model, m in alone.items():
        print(
            f"{model}: {m['requests']} requests, {m['errors']} errors; p99 TTFT "
            f"{m['ttft_p99_s']:.4f} s, TPOT {m['tpot_p99_s'] or 0:.4f} s -> SLO "
            f"{slos[model]['ttft_s']:.4f} / {slos[model]['tpot_s']:.4f} s"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"standalone": alone, "slos": slos, "k": args.k}))
    return 0


def _slos(args, rows) -> dict[str, dict] | None:
    """--slo for every model of the rows, or --slo-file; None: measure them."""
    if getattr(args, "slo", None):
        ttft, tpot = args.slo
        return {m: {"ttft_s": ttft, "tpot_s": tpot} for m in sorted({r.model for r in rows})}
    return _slo_file(args.slo_file) if args.slo_file else None


def _policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = sorted(set(policies) - {"prism", "static", "swap"})
    if bad or not policies:
        raise ValueError(f"--policies: unknown {bad}; choose from prism, static, swap")
    return policies


def _sweep_config(args, rows, **more):
    from prism_server.bench.sweep import SweepConfig

    owned = ("--policy", "--port", "--host", "--config", "--slo-file", "--request-log", "serve")
    for a in args.server_arg:
        if a.split("=", 1)[0] in owned:
            raise ValueError(f"--server-arg {a}: the sweep sets it itself, for each run")
    return SweepConfig(
        workload=args.workload,
        out=args.out,
        policies=_policies(args.policies),
        target=args.target,
        server_config=args.config,
        server_args=args.server_arg,
        slos=_slos(args, rows),
        fixed_slo=args.slo,
        k=args.k,
        standalone_requests=args.standalone_requests,
        standalone_max_output=args.standalone_max_output,
        budget_s=args.budget_s,
        stop_early=args.stop_early,
        sample_interval_s=args.sample_interval,
        startup_timeout_s=args.startup_timeout,
        settle_s=args.settle,
        api_key=args.api_key,
        plots=not args.no_plots,
        server_slos=not args.no_server_slos,
        request_log=not args.no_request_log,
        extra={"command": " ".join(sys.argv)},
        **more,
    )


def _sweep(args) -> int:
    from prism_server.bench.sweep import run_sweep
    from prism_server.bench.sweep_table import table

    rows = _rows(args.workload)
    subset = (args.static_subset or "").strip() or None
    if subset and subset != "auto":
        subset = [m.strip() for m in subset.split(",") if m.strip()]
    cfg = _sweep_config(
        args,
        rows,
        scales=args.scales,
        refine=args.refine,
        keep_going=args.keep_going,
        static_subset=subset,
    )
    sweep = asyncio.run(run_sweep(cfg, rows))
    print(table(sweep))
    return 0


def _capacity(args) -> int:
    from prism_server.bench.capacity import run_capacity, table

    rows = _rows(args.workload)
    cfg = _sweep_config(args, rows, scales=[args.scale])
    cap = asyncio.run(run_capacity(cfg, rows, args.scale, args.start, args.step))
    print(table(cap))
    return 0


def _report_slo(args) -> int:
    from prism_server.bench.sweep_table import slo_table

    sweep = _sweep_of(Path(args.dir))
    models = {
        r["model"] for p in sweep["policies"].values() for x in p["runs"] for r in x["requests"]
    }
    if args.slo:
        ttft, tpot = args.slo
        slos = {m: {"ttft_s": ttft, "tpot_s": tpot} for m in models}
        label = f"fixed: TTFT {ttft:g} s, TPOT {tpot:g} s for every model"
    else:
        slos, label = _slo_file(args.slo_file), f"from {args.slo_file}"
    text = slo_table(sweep, slos, label)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


def _sweep_of(d: Path) -> dict:
    from prism_server.bench.sweep import load_sweep

    sweep = load_sweep(d)
    if sweep is None:
        raise SystemExit(f"{d}: no sweep.json (nor sweep.json.gz) there")
    return sweep


def _plot(args) -> int:
    from prism_server.bench.plots import plot_sweep

    d = Path(args.dir)
    sweep = _sweep_of(d)
    for name, path in plot_sweep(sweep, d).items():
        print(f"{name}: {path}")
    return 0


def _simulate(args) -> int:
    from prism_server.bench.simulate import (
        fit_step_trace,
        markdown,
        simulate_sweep,
        step_ratios,
        with_step_costs,
    )

    sweep = _sweep_of(Path(args.dir))
    ratios = None
    if args.noise_seeds and not args.step_trace:
        raise ValueError("--noise-seeds draws from a step trace: give --step-trace")
    if args.step_trace:
        costs = fit_step_trace(args.step_trace)
        sweep = with_step_costs(sweep, costs, args.policy)
        ratios = step_ratios(args.step_trace, costs) if args.noise_seeds else None
    rows = _rows(args.workload or sweep["config"]["workload"])
    preds = simulate_sweep(
        sweep,
        rows,
        args.policy,
        args.scales,
        args.max_num_batched_tokens,
        ratios,
        args.noise_seeds,
    )
    print(markdown(args.policy, preds))
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    fn = {
        "run": _run,
        "standalone": _standalone,
        "sweep": _sweep,
        "capacity": _capacity,
        "report-slo": _report_slo,
        "plot": _plot,
        "simulate": _simulate,
    }.get(args.bench_command)
    if fn is None:
        from prism_server.bench.traces_cli import run_workload_command

        fn = run_workload_command
    try:
        return fn(args)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prism_server bench", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
