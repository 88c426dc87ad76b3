"""The request log (`ServerArgs.request_log`): one JSON line per request when it ends (finished,
aborted or failed), appended by the event loop from the request's final output: its response id,
model, finish reason, tokens, server-side TTFT, where its time went and its preemptions. A
benchmark joins it with what its clients saw by the response id (docs/API.md)."""

from __future__ import annotations

import json
from pathlib import Path

from scheduler.request import WAIT_CAUSES, RequestOutput


def record(
    response_id: str, model: str, out: RequestOutput, arrival: float, index: int | None = None
) -> dict:
    """The log record of a request whose final output is `out`; arrival: when the server
    accepted it (time.monotonic()); index: its choice in the response (None: the only one)."""
    waits = out.waits or {}
    first = out.first_token_time
    rec = {
        "id": response_id,
        "model": model,
        "finish_reason": out.finish_reason.value if out.finish_reason is not None else "error",
        "prompt_tokens": out.num_prompt_tokens,
        "output_tokens": out.num_output_tokens,
        "ttft_s": None if first is None else round(max(first - arrival, 0.0), 6),
        "waits": {c: round(waits.get(c, 0.0), 6) for c in WAIT_CAUSES},  # seconds
        "preemptions": out.num_preemptions,
        "recomputed_tokens": out.recomputed_tokens,
    }
    if index is not None:
        rec["index"] = index
    return rec


class RequestLog:
    """The file, opened once to append; each line is written whole and flushed as the request
    ends (a short write, done on the event loop), and the file closed at shutdown."""

    def __init__(self, path: str | Path):
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed by close())
        except OSError as e:
            raise ValueError(f"request_log: cannot open {path} to append: {e}") from None

    def write(self, rec: dict) -> None:
        if self._file.closed:  # a request that ended after shutdown
            return
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
