"""`python -m prism_server bench workload`: a workload CSV from a public trace (Azure LLM 2023,
ServeGen, Mooncake) or the shifting-bursty-groups generator, windowed, time- and rate-scaled,
lengths capped; prints how trace streams map to models and what the workload looks like."""

from __future__ import annotations

import argparse
from pathlib import Path

from prism_server.bench import workload as wl

SOURCES = ("azure", "servegen", "mooncake", "bursty")
# where request lengths may come from instead of the source's own: another trace's requests
LENGTHS = ("source", "azure-code", "azure-conv", "mooncake")


def _range(text: str) -> tuple[int, int]:
    """ "LO,HI" -> (LO, HI), 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _azure(root: Path, service: str) -> Path:
    """The Azure 2023 trace of `service` (code or conv) under the traces folder."""
    return root / "azure_llm_2023" / f"AzureLLMInferenceTrace_{service}.csv.gz"


def _mooncake(root: Path) -> Path:
    return root / "mooncake_fast25" / "conversation_trace.jsonl.gz"


# where the public traces are unpacked, unless --traces says otherwise
DEFAULT_TRACES = Path("../shared/traces")


def add_workload_command(sub) -> None:
    p = sub.add_parser("workload", help="write a workload CSV from a trace or the generator")
    p.add_argument("--source", choices=SOURCES, required=True)
    p.add_argument("--models", required=True, help="comma-separated served model names")
    p.add_argument("--out", required=True, help="the CSV written")
    p.add_argument("--traces", type=Path, default=None, help="the traces folder")
    p.add_argument("--start-s", type=float, default=0.0, help="where the window starts")
    p.add_argument("--duration-s", type=float, default=600.0, help="how long the window is")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="arrivals x this (0.1: ten times faster)"
    )
    p.add_argument("--rate-scale", type=float, default=1.0, help="requests x this (servegen)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="source",
        help="each request's (prompt, output) lengths: the source's own, or a pair drawn from "
        "another trace's requests (Azure code or conv, Mooncake's long-context conversations)",
    )
    p.add_argument("--max-prompt", type=int, default=None, help="cap prompt lengths")
    p.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    p.add_argument(
        "--servegen-models",
        default="m-large,m-mid,m-small",
        help="the ServeGen models whose client streams are mapped to served models",
    )
    p.add_argument(
        "--servegen-streams",
        help="servegen: the stream of each model in order (m-large/c61,...); default: the "
        "busiest streams in rank order",
    )
    p.add_argument("--rate", type=float, default=1.0, help="bursty: requests per second")
    p.add_argument("--shifts-per-hour", type=float, default=6.0, help="bursty")
    p.add_argument("--active-fraction", type=float, default=0.35, help="bursty")
    p.add_argument("--cv", type=float, default=2.0, help="bursty: inter-arrival CV")
    p.add_argument(
        "--prompt-range",
        type=_range,
        default=(64, 1024),
        help="bursty: prompt lengths, log-uniform in LO,HI",
    )
    p.add_argument(
        "--output-range",
        type=_range,
        default=(16, 256),
        help="bursty: output lengths, log-uniform in LO,HI",
    )


def build(args: argparse.Namespace) -> tuple[list[wl.Row], dict[str, str]]:
    """The rows and the mapping (served model -> the trace stream it replays)."""
    from prism_server.bench import traces

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise ValueError("--models: at least one model")
    root = args.traces or DEFAULT_TRACES
    end = args.start_s + args.duration_s
    if args.source == "azure":
        if len(models) != 2:
            raise ValueError("--source azure has two services (code, conv): name two models")
        files = {models[0]: _azure(root, "code"), models[1]: _azure(root, "conv")}
        rows = wl.window(wl.from_azure(files, limit_s=end), args.start_s, end)
        mapping = {models[0]: "azure/code", models[1]: "azure/conv"}
    elif args.source == "servegen":
        sources = [s.strip() for s in args.servegen_models.split(",") if s.strip()]
        streams = args.servegen_streams.split(",") if args.servegen_streams else None
        kw = dict(
            streams=streams,
            source_models=sources,
            start_s=args.start_s,
            duration_s=args.duration_s,
            root=root / "servegen",
        )
        rows = traces.from_servegen(
            models, rate_scale=args.rate_scale, seed=args.seed, window_scale=1.0, **kw
        )
        mapping = traces.servegen_mapping(models, **kw)
    elif args.source == "mooncake":
        path = _mooncake(root)
        rows = wl.window(
            traces.from_mooncake(models, path, limit_s=end, seed=args.seed), args.start_s, end
        )
        mapping = {
            m: f"mooncake, prefix-hash share {i + 1}/{len(models)}" for i, m in enumerate(models)
        }
    else:
        rows = wl.bursty_groups(
            models,
            args.duration_s,
            args.rate,
            shifts_per_hour=args.shifts_per_hour,
            active_fraction=args.active_fraction,
            cv=args.cv,
            prompt_len=args.prompt_range,
            output_len=args.output_range,
            seed=args.seed,
        )
        mapping = {m: "synthetic" for m in models}
    if args.lengths != "source":
        rows = wl.resample_lengths(rows, length_pairs(args.lengths, root), args.seed)
        mapping = {m: f"{s}, lengths from {args.lengths}" for m, s in mapping.items()}
    if args.time_scale != 1.0:
        rows = wl.scale_time(rows, args.time_scale)
    if args.max_prompt or args.max_output:
        rows = wl.clamp_lengths(rows, args.max_prompt or 1 << 30, args.max_output or 1 << 30)
    if not rows:
        raise ValueError("the window holds no request")
    return rows, mapping


def length_pairs(name: str, root: Path) -> list[tuple[int, int]]:
    """Every request's (prompt, output) lengths in the trace `name` (one of LENGTHS but source)."""
    from prism_server.bench import traces

    if name == "mooncake":
        rows = traces.from_mooncake(["m"], _mooncake(root))
    else:
        rows = wl.from_azure({"m": _azure(root, name.removeprefix("azure-"))})
    return [(r.prompt_len, r.output_len) for r in rows]


def describe(
    rows: list[wl.Row], models: list[str], time_scale: float = 1.0, span_s: float | None = None
) -> str:
    """The workload in a few lines: requests and rate as replayed, how the models take turns on
    the trace's own time (the arrivals are that x `time_scale`; `span_s`: the trace time the
    window covers, else up to the last arrival), each model's requests and mean lengths."""
    span = rows[-1].arrival_s
    per = {m: sum(r.model == m for r in rows) for m in models}
    act = wl.activity(rows, models, 60.0, time_scale, span_s)
    trace_span = span_s if span_s is not None else span / time_scale
    changes = "n/a" if act.changes_per_hour is None else f"{act.changes_per_hour:.0f}"
    lines = [
        f"{len(rows)} requests over {span:.1f} s ({len(rows) / max(span, 1e-9):.2f} req/s)",
        f"on the trace's time ({trace_span:.0f} s, {act.windows} minutes): models idle per "
        f"minute {100 * act.idle_mean:.0f}% (min {100 * act.idle_min:.0f}%, max "
        f"{100 * act.idle_max:.0f}%); active set changes per hour: {changes}",
    ]
    for m in models:
        mine = [r for r in rows if r.model == m]
        if mine:
            prompt = sum(r.prompt_len for r in mine) / len(mine)
            output = sum(r.output_len for r in mine) / len(mine)
            lines.append(
                f"  {m}: {per[m]} requests, prompt mean {prompt:.0f}, output mean {output:.0f}"
            )
        else:
            lines.append(f"  {m}: no requests")
    return "\n".join(lines)


def run_workload_command(args: argparse.Namespace) -> int:
    rows, mapping = build(args)
    wl.write_csv(rows, args.out)
    for model, stream in mapping.items():
        print(f"{model} <- {stream}")
    # bursty: generated on [0, duration); the traces: the window [start, start + duration)
    print(describe(rows, list(mapping), args.time_scale, args.duration_s))
    print(f"wrote {args.out}")
    return 0
