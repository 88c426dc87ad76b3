"""Replays a workload against a running server over HTTP (the completions API, streaming) and
records what each request saw: its arrival, every token's time, its error. Each row becomes one
request sent at its arrival time (relative to the start), with a token-id prompt of exactly
`prompt_len` tokens, `max_tokens` = `output_len` and `ignore_eos`, so the lengths are the trace's.

Nothing here imports the engine: a bench measures a server as a client does.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from prism_server.bench.monitor import Monitor
from prism_server.bench.workload import Row


@dataclass
class Result:
    row: Row
    sent: float = 0.0  # seconds from the start of the replay
    token_times: list[float] = field(default_factory=list)  # seconds from the start
    tokens: int = 0
    status: int = 0
    error: str | None = None
    done: bool = False  # the stream ended (or failed)
    id: str | None = None  # the response id (the first streamed chunk's "id")

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens >= 1

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None

    def missed(self, ttft_slo: float, tpot_slo: float, now: float) -> bool:
        """Whether this request has already failed its SLOs for certain, `now` seconds from the
        start: an error, a first token later than the TTFT SLO (or none by then), or a stream
        still short of its last token when even instant tokens from now on would leave its mean
        inter-token time over the TPOT SLO. Implies that the report counts it as a miss."""
        if self.error is not None or (self.done and not self.ok):
            return True
        if not self.sent and not self.token_times:
            return False  # not sent yet (a request is sent at > 0 s)
        if self.ttft is not None:
            if self.ttft > ttft_slo:
                return True
        elif now - self.sent > ttft_slo:
            return True
        n = self.row.output_len
        if self.done:
            return self.tpot is not None and self.tpot > tpot_slo
        # not done: the last token comes after now, and at most n tokens come in all
        return bool(self.token_times) and n > 1 and now - self.token_times[0] > tpot_slo * (n - 1)


def allowed_misses(n: int, target: float) -> int:
    """How many of n requests may miss while the attainment still reaches `target`."""
    return n - math.ceil(target * n - 1e-9)


def prompt_ids(row: Row, index: int, vocab: int = 256) -> list[int]:
    """A token-id prompt of exactly row.prompt_len tokens (ids in [10, vocab)). It opens with the
    request's index in base vocab - 10 (three digits), so that no two requests of a run share a
    prefix (a prefix cache would find it) up to (vocab - 10) ** 3 requests."""
    base = vocab - 10
    head = [10 + (index // base**k) % base for k in (2, 1, 0)]
    body = [10 + (index * 7919 + j * 31) % base for j in range(row.prompt_len)]
    return (head + body)[: row.prompt_len]


async def _one(session, url: str, i: int, row: Row, res: Result, t0: float, key: str | None):
    body = {
        "model": row.model,
        "prompt": prompt_ids(row, i),
        "max_tokens": row.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,  # each chunk then names its tokens: exact counts whatever the text
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    res.sent = time.monotonic() - t0
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            res.status = r.status
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if res.id is None and chunk.get("id"):
                    res.id = chunk["id"]
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    continue
                choice = chunk["choices"][0]
                lp = choice.get("logprobs") or {}
                n = len(lp.get("tokens") or ()) or (1 if choice.get("text") else 0)
                now = time.monotonic() - t0
                res.token_times.extend([now] * n)
                res.tokens += n
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.done = True


STOPPED = "the run stopped early: the target attainment could no longer be reached"


@dataclass
class EarlyStop:
    """Stop a replay once more requests than `misses` have certainly missed their SLOs
    (model -> (TTFT SLO s, TPOT SLO s)): the rest of the run cannot change that it fails.
    After the replay, `at_s` is when it stopped (None: it ran to the end) and `missed` how many
    had missed by then."""

    slos: Mapping[str, tuple[float, float]]
    misses: int
    at_s: float | None = None
    missed: int = 0

    def count(self, results: Sequence[Result], now: float) -> int:
        return sum(r.missed(*self.slos[r.row.model], now) for r in results)


async def replay(
    url: str,
    rows: Sequence[Row],
    api_key: str | None = None,
    timeout_s: float = 600.0,
    monitor: Monitor | None = None,
    progress: bool = True,
    stop: EarlyStop | None = None,
) -> list[Result]:
    """Sends every row at its arrival time; returns once all have finished (results in row
    order). With a monitor, the server's status is sampled from just before the first request to
    just after the last one finished (its t0 is set to the replay's start). The progress bar
    (finished requests) shows only on a terminal. With `stop`, the replay ends as soon as more
    requests than it allows have missed their SLOs: the requests in flight are cancelled (the
    server sees their clients go) and the rest are not sent; both get the error STOPPED."""
    results = [Result(r) for r in rows]
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    bar = tqdm(total=len(rows), unit="req", disable=None if progress else True, leave=False)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        if monitor is not None:
            monitor.t0 = t0
            await monitor.poll(session)
            monitor.start(session)

        async def one(i: int, row: Row, res: Result) -> None:
            await _one(session, url, i, row, res, t0, api_key)
            bar.update()

        tasks = []

        async def send_all() -> None:
            for i, (row, res) in enumerate(zip(rows, results)):
                delay = row.arrival_s - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, row, res)))
            await asyncio.gather(*tasks)

        sender = asyncio.create_task(send_all())
        if stop is None:
            await sender
        else:
            while not sender.done():
                await asyncio.wait([sender], timeout=0.05)
                now = time.monotonic() - t0
                stop.missed = stop.count(results, now)
                if stop.missed > stop.misses and not sender.done():
                    stop.at_s = now
                    cut = [r for r in results if not r.done]  # in flight or not sent
                    for t in (sender, *tasks):
                        t.cancel()
                    await asyncio.gather(sender, *tasks, return_exceptions=True)
                    for res in cut:
                        res.error, res.done = STOPPED, True
            if sender.done() and not sender.cancelled() and sender.exception():
                raise sender.exception()
        if monitor is not None:
            await monitor.stop(session)
    bar.close()
    return results
