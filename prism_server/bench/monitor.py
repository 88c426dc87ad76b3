"""Samples the server's `GET /v1/status` while a replay runs: memory per model over time (weights
and KV), each model's residency timeline, and the activation and eviction counts over the run.

The server's times are its monotonic clock; each poll maps them onto the replay's clock (seconds
from its start) with the offset seen by the poll with the shortest round trip.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Monitor:
    url: str
    t0: float  # the replay's start (time.monotonic())
    interval_s: float = 0.25
    api_key: str | None = None
    samples: list[dict] = field(default_factory=list)
    # per model: server time -> the state it entered then
    transitions: dict[str, dict[float, str]] = field(default_factory=dict)
    # per poll, per model: (activations, evictions) so far
    counts: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    # per poll: (its time on the replay's clock, per device its engine counters)
    engines: list[tuple[float, dict[str, dict]]] = field(default_factory=list)
    # per model, from the latest poll: its latency model's coefficients (what its steps cost on
    # the device), their error, and the KV blocks it could hold
    latency: dict[str, dict] = field(default_factory=dict)
    _offset: float | None = None  # server clock - client clock
    _rtt: float = float("inf")
    _task: asyncio.Task | None = None

    async def poll(self, session: aiohttp.ClientSession) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        c0 = time.monotonic()
        async with session.get(self.url + "/v1/status", headers=headers) as r:
            r.raise_for_status()
            st = await r.json()
        c1 = time.monotonic()
        if c1 - c0 < self._rtt:
            self._rtt, self._offset = c1 - c0, st["time"] - (c0 + c1) / 2
        models, counts = {}, {}
        engines = {dev["device"]: dev["engine"] for dev in st["devices"]}
        for dev in st["devices"]:
            for m in dev["models"]:
                name = m["name"]
                models[name] = {
                    "device": dev["device"],
                    "residency": m["residency"],
                    "weight_bytes": m["weight_pool_bytes"],
                    "kv_bytes": m["kv_bytes"],
                    "kv_used_bytes": m["kv_used_bytes"],
                    "running": m["num_running"],
                    "waiting": m["num_waiting"],
                }
                counts[name] = (m["activations"], m["evictions"])
                for a in m.get("adapters", ()):  # its LoRA adapters' moves count as its own
                    counts[a["name"]] = (a["activations"], a["evictions"])
                lat = m.get("latency") or {}
                if lat.get("coefficients"):
                    self.latency[name] = {
                        "coefficients": lat["coefficients"],
                        "error": lat.get("error"),
                        "kv_blocks_capacity": m["kv_blocks_capacity"],
                    }
                log = self.transitions.setdefault(name, {})
                for t, state in m["transitions"]:
                    log[t] = state
        self.samples.append({"t": (c0 + c1) / 2 - self.t0, "models": models})
        self.counts.append(counts)
        self.engines.append(((c0 + c1) / 2 - self.t0, engines))

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll(session)
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                continue  # a missed sample is not fatal; the next poll catches up

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._run(session))

    async def stop(self, session: aiohttp.ClientSession) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.poll(session)  # the final state and counts

    # ---- what it saw, on the replay's clock ----------------------------------------------------
    def _client(self, server_t: float) -> float:
        return server_t - (self._offset or 0.0) - self.t0

    def timeline(self) -> dict[str, list[tuple[float, str]]]:
        """Per model: (time it entered a state, the state), oldest first, from before the replay
        started (negative times) to its end."""
        return {
            name: [(self._client(t), s) for t, s in sorted(log.items())]
            for name, log in sorted(self.transitions.items())
        }

    def moved(self) -> tuple[int, int]:
        """Activations and evictions between the first and the last poll, over all models and
        LoRA adapters."""
        if len(self.counts) < 2:
            return 0, 0
        first, last = self.counts[0], self.counts[-1]
        acts = sum(a - first.get(m, (0, 0))[0] for m, (a, _) in last.items())
        evs = sum(e - first.get(m, (0, 0))[1] for m, (_, e) in last.items())
        return acts, evs

    def engine(self) -> dict[str, dict]:
        """Per device, between the first and the last poll: the model steps run, the time
        spent in them (step_seconds: the device's busy seconds) and its fraction of the time
        (busy), and the host time between back-to-back steps (mean per step, and as a fraction
        of the time)."""
        if len(self.engines) < 2:
            return {}
        (t0, first), (t1, last) = self.engines[0], self.engines[-1]
        wall = max(t1 - t0, 1e-9)
        out = {}
        for dev, e in last.items():
            b = first.get(dev, {})
            steps = e["steps"] - b.get("steps", 0)
            host = e["host_seconds"] - b.get("host_seconds", 0.0)
            out[dev] = {
                "steps": steps,
                "step_seconds": e["step_seconds"] - b.get("step_seconds", 0.0),
                "busy": (e["step_seconds"] - b.get("step_seconds", 0.0)) / wall,
                "host": host / wall,
                "host_per_step_s": host / steps if steps else None,
            }
        return out


def state_at(timeline: list[tuple[float, str]], t: float) -> str | None:
    """The state a timeline (from Monitor.timeline) is in at time t; before its first entry, the
    first entry's state (None: an empty timeline)."""
    if not timeline:
        return None
    i = bisect.bisect_right([x for x, _ in timeline], t) - 1
    return timeline[max(i, 0)][1]
