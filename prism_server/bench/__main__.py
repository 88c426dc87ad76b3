"""`python -m prism_server bench`: replay a workload against a running Prism over HTTP and print
the per-model table (and write JSON / markdown)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from prism_server.bench.replay import replay
from prism_server.bench.report import markdown, report
from prism_server.bench.workload import read_csv, scale_rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server to measure")
    p.add_argument(
        "--workload", required=True, help="CSV: arrival_s, model, prompt_len, output_len"
    )
    p.add_argument("--rate-scale", type=float, default=1.0, help="replay at this x the rate")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=100.0)
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--markdown", help="write the table here")


def run(args: argparse.Namespace) -> int:
    try:
        rows = scale_rate(read_csv(args.workload), args.rate_scale)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("error: the workload has no rows", file=sys.stderr)
        return 2
    results = asyncio.run(replay(args.url, rows, args.api_key))
    slo = (args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    rep = report(results, {r.model: slo for r in rows}, rows[-1].arrival_s or 1.0)
    table = markdown(rep)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prism_server bench", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
