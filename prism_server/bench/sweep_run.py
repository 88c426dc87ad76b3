"""One run of a sweep: the workload replayed at one rate scale against a running server while
its status is sampled; the run's record (its report, every request, the status samples, the
residency timelines, the activations and evictions, each missed request's cause from the
server's request log).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prism_server.bench.causes import collect, join, log_size
from prism_server.bench.monitor import Monitor, state_at
from prism_server.bench.replay import EarlyStop, Result, allowed_misses, replay
from prism_server.bench.report import percentile, report
from prism_server.bench.workload import Row, scale_rate


def _record(res: Result, waited: bool | None = None) -> dict:
    """One request's record (waited: whether its model was not resident when it was sent;
    None: not known)."""
    gaps = res.gaps
    return {
        "id": res.id,
        "model": res.row.model,
        "prompt_len": res.row.prompt_len,
        "output_len": res.row.output_len,
        "arrival_s": res.row.arrival_s,
        "sent_s": res.sent,
        "ttft_s": res.ttft,
        "tpot_s": res.tpot,
        "e2e_s": res.e2e,
        "max_gap_s": max(gaps) if gaps else None,
        "tokens": res.tokens,
        "error": res.error,
    } | ({} if waited is None else {"waited_activation": waited})


def _slo_tuples(slos: dict[str, dict], models) -> dict[str, tuple[float, float]]:
    missing = sorted(set(models) - set(slos))
    if missing:
        raise ValueError(f"no SLO for models {missing}")
    return {m: (slos[m]["ttft_s"], slos[m]["tpot_s"]) for m in models}


async def run_once(
    url: str,
    rows: Sequence[Row],
    slos: dict[str, dict],
    scale: float,
    base_rate: float,
    interval_s: float = 0.25,
    api_key: str | None = None,
    stop_below: float | None = None,
    request_log: Path | None = None,
) -> dict:
    """Replays `rows` at `scale` x their rate, sampling the status; the run's record.
    stop_below: end the run as soon as its joint attainment can no longer reach this.
    request_log: the server's request log, whose lines written during the run give each request's
    waits and preemptions and each missed one its cause."""
    scaled = scale_rate(rows, scale)
    span = max(scaled[-1].arrival_s, 1e-9)
    mon = Monitor(url, 0.0, interval_s, api_key)
    slo = _slo_tuples(slos, {r.model for r in rows})
    stop = None if stop_below is None else EarlyStop(slo, allowed_misses(len(rows), stop_below))
    offset = log_size(request_log)
    results = await replay(url, scaled, api_key, monitor=mon, stop=stop)
    lines = await collect(request_log, offset, [r.id for r in results])
    timeline = mon.timeline()
    waited = [  # a request the run stopped before sending waited for nothing
        r.sent > 0 and state_at(timeline.get(r.row.model, []), r.sent) not in (None, "resident")
        for r in results
    ]
    duration = max([span] + [r.sent + (r.e2e or 0.0) for r in results])
    stopped = None
    if stop is not None and stop.at_s is not None:
        duration = stop.at_s
        stopped = {
            "at_s": stop.at_s,
            "missed": stop.missed,
            "sent": sum(r.sent > 0 for r in results),
            "attainment_at_most": 1 - stop.missed / len(results),
        }
    rep = report(results, slo, span)
    wait_ttfts = [r.ttft for r, w in zip(results, waited) if w and r.ttft is not None]
    acts, evs = mon.moved()
    transitions = {}
    for model, tl in timeline.items():
        before = [s for t, s in tl if t <= 0]  # the state at the start, then what changed
        seq = ([[0.0, before[-1]]] if before else []) + [[t, s] for t, s in tl if 0 < t <= duration]
        transitions[model] = seq
    records = [_record(r, w) for r, w in zip(results, waited)]
    why = join(records, lines, slo)
    return {
        "scale": scale,
        "rate_rps": base_rate * scale,
        "duration_s": duration,
        "report": rep,
        "activations": acts,
        "evictions": evs,
        "miss_causes": why["miss_causes"],
        "preemptions": why["preemptions"],
        "recomputed_tokens": why["recomputed_tokens"],
        "logged_requests": why["logged"],
        "activation_wait": {
            "requests": sum(waited),
            "ttft_p50_s": percentile(wait_ttfts, 50),
            "ttft_p99_s": percentile(wait_ttfts, 99),
        },
        "engine": mon.engine(),
        "latency": mon.latency,
        "requests": records,
        "samples": mon.samples,
        "transitions": transitions,
        "stopped_early": stopped,
    }
