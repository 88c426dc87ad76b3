"""SLOs the way the field sets them: measure each model alone at low load (one request at a time,
after a warm-up that also activates it), take the p99 TTFT and TPOT, and set each SLO to k times
that (k = 5 by default).

The requests measured are spread over the model's prompt lengths in the workload, its longest
included, so the p99 is the tail of the lengths it will serve; outputs are capped (the TPOT of a
lone request hardly changes along its output, and the measurement stays short)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import aiohttp

from prism_server.bench.replay import Result, _one
from prism_server.bench.report import percentile
from prism_server.bench.workload import Row


def pick(rows: Sequence[Row], n: int) -> list[Row]:
    """n rows spread evenly over `rows` by prompt length, the shortest and the longest included
    (all of them if there are fewer)."""
    rows = sorted(rows, key=lambda r: r.prompt_len)
    if len(rows) <= n:
        return rows
    if n == 1:
        return [rows[-1]]
    return [rows[round(i * (len(rows) - 1) / (n - 1))] for i in range(n)]


async def standalone(
    url: str,
    rows: Sequence[Row],
    per_model: int = 10,
    api_key: str | None = None,
    max_output: int = 64,
) -> dict[str, dict]:
    """Per model of `rows`: `per_model` of its requests (spread over its prompt lengths, outputs
    capped at max_output), sent one at a time after one warm-up; their TTFT and TPOT p99."""
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    out = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for model, mine in sorted(by_model.items()):
            chosen = [replace(r, output_len=min(r.output_len, max_output)) for r in mine]
            chosen = pick(chosen, per_model)
            results = []
            for i, row in enumerate([chosen[-1], *chosen]):
                res = Result(row)
                await _one(session, url, i, row, res, time.monotonic(), api_key)
                if i:  # the first is the warm-up (the longest prompt)
                    results.append(res)
            good = [r for r in results if r.ok]
            out[model] = {
                "requests": len(results),
                "errors": len(results) - len(good),
                "ttft_p99_s": percentile([r.ttft for r in good], 99),
                "tpot_p99_s": percentile([r.tpot for r in good if r.tpot is not None], 99),
            }
    return out


def slos_from(standalone: dict[str, dict], k: float) -> dict[str, dict]:
    """model -> {"ttft_s", "tpot_s"}: k x the standalone p99 (a model that produced nothing
    measurable is an error: its SLO would be meaningless)."""
    slos = {}
    for model, m in standalone.items():
        if m["ttft_p99_s"] is None:
            raise RuntimeError(f"standalone: no request of {model} succeeded")
        tpot = m["tpot_p99_s"] if m["tpot_p99_s"] is not None else m["ttft_p99_s"]
        slos[model] = {"ttft_s": k * m["ttft_p99_s"], "tpot_s": k * tpot}
    return slos
