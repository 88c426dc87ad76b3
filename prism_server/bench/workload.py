"""Workloads for the bench: one request per row (`arrival_s, model, prompt_len, output_len`), read
and written as CSV, scaled in time or rate, converted from public traces, or generated.

The synthetic generator makes shifting bursty groups, the pattern production multi-model traces
show: at any time a small active set of models receives requests (gamma inter-arrival times with a
coefficient of variation above 1, so requests come in bursts), the set changes several times an
hour, and popularity within it is skewed (Zipf), so most models sit idle most of the time.
`activity` measures that pattern in any workload, on the trace's own time: the models idle per
minute and the active-set changes per hour.

Pure Python over rows: nothing here imports the engine.
"""

from __future__ import annotations

import csv
import gzip
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

FIELDS = ("arrival_s", "model", "prompt_len", "output_len")


@dataclass(frozen=True)
class Row:
    arrival_s: float
    model: str
    prompt_len: int
    output_len: int

    def __post_init__(self):
        if self.arrival_s < 0 or self.prompt_len < 1 or self.output_len < 1 or not self.model:
            raise ValueError(f"not a valid workload row: {self}")


def read_csv(path: str | Path) -> list[Row]:
    """Rows sorted by arrival; a bad row is an error naming its line."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for i, r in enumerate(reader, start=2):
            try:
                rows.append(
                    Row(
                        float(r["arrival_s"]),
                        r["model"].strip(),
                        int(r["prompt_len"]),
                        int(r["output_len"]),
                    )
                )
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return sorted(rows, key=lambda r: r.arrival_s)


def write_csv(rows: Iterable[Row], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in rows:
            w.writerow((f"{r.arrival_s:.6f}", r.model, r.prompt_len, r.output_len))


def scale_time(rows: Sequence[Row], factor: float) -> list[Row]:
    """Arrivals stretched (factor > 1) or compressed (< 1): the same requests, rate / factor."""
    if factor <= 0:
        raise ValueError("the time factor must be positive")
    return [replace(r, arrival_s=r.arrival_s * factor) for r in rows]


def scale_rate(rows: Sequence[Row], factor: float) -> list[Row]:
    """The same trace at `factor` times its request rate over the same span."""
    return scale_time(rows, 1.0 / factor)


def resample_lengths(
    rows: Sequence[Row], pairs: Sequence[tuple[int, int]], seed: int = 0
) -> list[Row]:
    """The same arrivals and models with each request's (prompt, output) lengths drawn, as a
    pair, from `pairs` (another trace's requests, say), with replacement; deterministic for a
    seed."""
    if not pairs:
        raise ValueError("no length pairs to draw from")
    rng = random.Random(f"lengths/{seed}")
    out = []
    for r in rows:
        p, o = pairs[rng.randrange(len(pairs))]
        out.append(replace(r, prompt_len=max(int(p), 1), output_len=max(int(o), 1)))
    return out


def window(rows: Sequence[Row], start_s: float, end_s: float) -> list[Row]:
    """The rows arriving in [start_s, end_s), shifted to start at 0."""
    return [
        replace(r, arrival_s=r.arrival_s - start_s) for r in rows if start_s <= r.arrival_s < end_s
    ]


def clamp_lengths(rows: Sequence[Row], max_prompt: int, max_output: int) -> list[Row]:
    """Lengths capped so that every request fits the served models."""
    return [
        replace(
            r, prompt_len=min(r.prompt_len, max_prompt), output_len=min(r.output_len, max_output)
        )
        for r in rows
    ]


# ---- public traces ---------------------------------------------------------------------------
def _azure_time(stamp: str) -> float:
    day, _, frac = stamp.partition(".")
    t = datetime.strptime(day, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def from_azure(files: dict[str, str | Path], limit_s: float | None = None) -> list[Row]:
    """Azure LLM inference 2023 (code, conv): model name -> trace file (csv or csv.gz with
    TIMESTAMP, ContextTokens, GeneratedTokens). Arrivals from the earliest timestamp of all."""
    raw: list[tuple[float, str, int, int]] = []
    for model, path in files.items():
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", newline="") as f:
            for r in csv.DictReader(f):
                raw.append(
                    (
                        _azure_time(r["TIMESTAMP"]),
                        model,
                        max(int(r["ContextTokens"]), 1),
                        max(int(r["GeneratedTokens"]), 1),
                    )
                )
    if not raw:
        return []
    t0 = min(t for t, *_ in raw)
    rows = [Row(t - t0, m, p, o) for t, m, p, o in raw]
    if limit_s is not None:
        rows = [r for r in rows if r.arrival_s < limit_s]
    return sorted(rows, key=lambda r: r.arrival_s)


# ---- synthetic shifting bursty groups --------------------------------------------------------
def bursty_groups(
    models: Sequence[str],
    duration_s: float,
    rate: float,
    shifts_per_hour: float = 6.0,
    active_fraction: float = 0.35,
    cv: float = 2.0,
    zipf: float = 1.0,
    prompt_len: tuple[int, int] = (64, 1024),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[Row]:
    """Requests at `rate` per second in all over `duration_s`: the active set (a fraction of the
    models, at least one) is redrawn `shifts_per_hour` times an hour; within it a model's share
    follows Zipf(zipf) over a random ranking; inter-arrival times are gamma with coefficient of
    variation `cv` (> 1: bursty); lengths log-uniform in the given ranges."""
    if not models or duration_s <= 0 or rate <= 0 or cv <= 0:
        raise ValueError("models, a positive duration, rate and cv are needed")
    rng = random.Random(seed)
    k = max(1, round(active_fraction * len(models)))
    period = 3600.0 / shifts_per_hour if shifts_per_hour > 0 else duration_s
    shape = 1.0 / (cv * cv)  # gamma: mean = shape * scale = 1 / rate, CV = 1 / sqrt(shape)
    scale = 1.0 / (rate * shape)
    rows: list[Row] = []
    t, phase_end, active, weights = 0.0, 0.0, [], []
    while True:
        t += rng.gammavariate(shape, scale)
        if t >= duration_s:
            return rows
        while t >= phase_end:  # a new bursty group
            active = rng.sample(list(models), k)
            weights = [1.0 / (i + 1) ** zipf for i in range(k)]
            phase_end += period
        model = rng.choices(active, weights)[0]
        rows.append(Row(t, model, _log_uniform(rng, *prompt_len), _log_uniform(rng, *output_len)))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


# ---- activity statistics on the trace's own time ----------------------------------------------
def active_sets(
    rows: Sequence[Row],
    models: Sequence[str],
    window_s: float = 60.0,
    time_scale: float = 1.0,
    span_s: float | None = None,
) -> list[frozenset[str]]:
    """The models of `models` with a request in each window of `window_s` seconds of the trace's
    own time, from 0 on. The rows' arrivals are the trace's times x `time_scale` (the factor of
    `scale_time`, so 1/60 when an hour was compressed into a minute): arrival / time_scale is the
    trace's time. The windows cover [0, span_s) of trace time, or up to the last arrival."""
    if window_s <= 0 or time_scale <= 0:
        raise ValueError("the window and the time scale must be positive")
    if not models:
        raise ValueError("name at least one model")
    wanted = set(models)
    times = [(r.arrival_s / time_scale, r.model) for r in rows if r.model in wanted]
    if span_s is None:  # through the window of the last arrival
        n = int(max((t for t, _ in times), default=0.0) // window_s) + 1
    elif span_s > 0:
        n = math.ceil(span_s / window_s)
    else:
        raise ValueError("the span must be positive")
    sets: list[set[str]] = [set() for _ in range(n)]
    for t, model in times:
        i = int(t // window_s)
        if i < n:  # past span_s: left out
            sets[i].add(model)
    return [frozenset(s) for s in sets]


@dataclass(frozen=True)
class Activity:
    """How a workload's models take turns, on the trace's own time: the fraction of models idle
    (no request) per window, its mean, min and max over the windows, and the active-set changes
    per hour (models that become active plus those that become idle between consecutive windows,
    summed, per hour of trace time; None with a single window)."""

    window_s: float
    windows: int
    idle_mean: float
    idle_min: float
    idle_max: float
    changes: int
    changes_per_hour: float | None


def activity(
    rows: Sequence[Row],
    models: Sequence[str],
    window_s: float = 60.0,
    time_scale: float = 1.0,
    span_s: float | None = None,
) -> Activity:
    """The idle fractions and active-set changes of `active_sets` (same arguments: rows already
    compressed by `time_scale`, windows of `window_s` seconds of trace time)."""
    sets = active_sets(rows, models, window_s, time_scale, span_s)
    idle = [1.0 - len(s) / len(set(models)) for s in sets]
    changes = sum(len(a ^ b) for a, b in zip(sets, sets[1:]))
    per_hour = changes * 3600.0 / (window_s * (len(sets) - 1)) if len(sets) > 1 else None
    return Activity(
        window_s=window_s,
        windows=len(sets),
        idle_mean=sum(idle) / len(idle),
        idle_min=min(idle),
        idle_max=max(idle),
        changes=changes,
        changes_per_hour=per_hour,
    )
