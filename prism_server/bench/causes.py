"""Why a run's requests missed: the server's request log (`serve --request-log FILE`, one JSON
line per request when it ends: its response id, where its time went, its preemptions) joined
to the bench's records by response id.

A missed request's cause: an error -> "error", a request the run cut when it stopped early ->
"stopped"; a TTFT miss -> the largest of its waits before the first token (offloaded, activation,
kv, other_models, queue, prefill); a TPOT-only miss -> the largest of its waits after it (decode:
its own decode, decode_other_models: other models' steps, preempted: waiting to be recomputed);
a request the log has no line for -> "unknown" (a server without the log, or a line not written
yet). The counts of a run add up to its missed requests. Nothing here imports the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from prism_server.bench.replay import STOPPED

TTFT_WAITS = ("offloaded", "activation", "kv", "other_models", "queue", "prefill")
TPOT_WAITS = ("decode", "decode_other_models", "preempted")
CAUSES = (*TTFT_WAITS, *TPOT_WAITS, "error", "stopped", "unknown")


def met(record: Mapping, ttft_slo: float, tpot_slo: float) -> bool:
    """Whether a request record met both SLOs (the report's rule: answered without error, first
    token within the TTFT SLO, mean inter-token time within the TPOT SLO)."""
    if record["error"] is not None or record["tokens"] < 1 or record["ttft_s"] is None:
        return False
    return record["ttft_s"] <= ttft_slo and (
        record["tpot_s"] is None or record["tpot_s"] <= tpot_slo
    )


def cause(record: Mapping, ttft_slo: float, tpot_slo: float, line: Mapping | None) -> str | None:
    """A request's miss cause (None: it met its SLOs)."""
    if met(record, ttft_slo, tpot_slo):
        return None
    if record["error"] == STOPPED:
        return "stopped"
    if record["error"] is not None or record["tokens"] < 1:
        return "error"
    waits = (line or {}).get("waits")
    if not waits:
        return "unknown"
    keys = TTFT_WAITS if record["ttft_s"] is None or record["ttft_s"] > ttft_slo else TPOT_WAITS
    return max(keys, key=lambda k: waits.get(k) or 0.0)  # ties: the first named


def log_size(path: Path | None) -> int:
    """The log's length now: a run reads the lines written after it."""
    try:
        return path.stat().st_size if path is not None else 0
    except FileNotFoundError:
        return 0


def read_log(path: Path | None, offset: int = 0) -> dict[str, dict]:
    """The request log's complete lines from `offset` (bytes), by response id; no file: none.
    A line cut short (being written) or not JSON is skipped."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return {}
    out = {}
    for raw in data.split(b"\n")[:-1]:  # the part after the last newline is not complete
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("id"):
            out[line["id"]] = line
    return out


async def collect(
    path: Path | None, offset: int, ids: Sequence[str | None], wait_s: float = 3.0
) -> dict[str, dict]:
    """The log lines of `ids` written after `offset`: waits up to wait_s for the server to write
    the lines of requests that just ended (no log: none, at once)."""
    want = {i for i in ids if i}
    deadline = time.monotonic() + wait_s
    while True:
        lines = read_log(path, offset)
        if path is None or want <= set(lines) or time.monotonic() >= deadline:
            return lines
        await asyncio.sleep(0.1)


def join(
    records: Sequence[dict], lines: Mapping[str, Mapping], slos: Mapping[str, tuple[float, float]]
) -> dict:
    """Stores in each record its log line's waits, preemptions and recomputed tokens (None
    where it has no line) and its miss cause (None: met); returns the run's miss causes (count
    per cause, adding up to its missed requests), preemptions, recomputed tokens and how many
    requests the log named."""
    causes: Counter[str] = Counter()
    pre = recomputed = logged = 0
    for rec in records:
        line = lines.get(rec.get("id") or "")
        logged += line is not None
        rec["waits"] = dict(line["waits"]) if line and line.get("waits") else None
        rec["preemptions"] = line.get("preemptions") if line else None
        rec["recomputed_tokens"] = line.get("recomputed_tokens") if line else None
        pre += rec["preemptions"] or 0
        recomputed += rec["recomputed_tokens"] or 0
        rec["cause"] = cause(rec, *slos[rec["model"]], line)
        if rec["cause"] is not None:
            causes[rec["cause"]] += 1
    return {
        "miss_causes": {c: causes[c] for c in CAUSES if causes[c]},
        "preemptions": pre,
        "recomputed_tokens": recomputed,
        "logged": logged,
    }
