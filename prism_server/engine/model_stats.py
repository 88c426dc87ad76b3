"""What one model on a device publishes: its SLO outcomes (all time and the last minute), the
ModelSnapshot built from its KV, scheduler, residency and latency model, and the history a
worker of the same model on another device takes over (inherit)."""

from __future__ import annotations

import time
from collections import deque

from scheduler.latency_model import LatencyModel
from scheduler.request import Request
from scheduler.snapshot import LatencySnapshot, ModelSnapshot

SLO_LOG = 4096  # SLO outcomes kept
SLO_WINDOW_S = 60.0  # what `slo_recent` covers
SLO_SCALE = 5.0  # an unset SLO: this many times the standalone estimate (the field's habit)


class ModelStats:
    """The accounting half of a ModelWorker: requests taken, SLO outcomes, the latency model,
    and the snapshot. It reads the worker's `kv`, `scheduler`, `weights` and residency fields.
    Engine thread only."""

    def __init__(self, ttft_slo_s: float | None, tpot_slo_s: float | None):
        """ttft/tpot_slo_s: the model's SLOs (None: SLO_SCALE x the latency model's standalone
        estimate of each request)."""
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.requests_total = 0
        self.slo = {k: [0, 0] for k in ("ttft", "tpot")}  # [met, missed] of finished requests
        # the outcomes of the last SLO_WINDOW_S (at most SLO_LOG), (time, kind, missed), and
        # their counts, kept as they come and go (a snapshot reads them, never scans the log)
        self.slo_log: deque[tuple[float, str, bool]] = deque()
        self._slo_recent = {k: [0, 0] for k in self.slo}
        self.num_deferred = 0  # waiting requests the arbitrator last deferred
        self.latency = LatencyModel()  # kept across evictions: a reactivation does not profile

    def set_slos(self, req: Request) -> None:
        """A new request's SLOs where it brings none: the model's, or SLO_SCALE x the latency
        model's standalone estimate."""
        n = req.num_prompt_tokens
        if req.ttft_slo is None:
            req.ttft_slo = self.ttft_slo_s or SLO_SCALE * self.latency.prefill_s(n)
        if req.tpot_slo is None:
            req.tpot_slo = self.tpot_slo_s or SLO_SCALE * self.latency.decode_s(1, n)
        self.requests_total += 1

    def ttft_outcome(self, req: Request, now: float) -> None:
        """req's first token came at `now`: its TTFT outcome."""
        if req.ttft_slo is not None:
            self._slo("ttft", now - req.arrival_time > req.ttft_slo, now)

    def tpot_outcome(self, req: Request) -> None:
        """req ended: its TPOT outcome (over its tokens after the first)."""
        n = req.num_output_tokens
        if n > 1 and req.tpot_slo is not None and req.first_token_time is not None:
            tpot = (req.last_token_time - req.first_token_time) / (n - 1)
            self._slo("tpot", tpot > req.tpot_slo, req.last_token_time)

    def _slo(self, kind: str, missed: bool, now: float) -> None:
        self.slo[kind][missed] += 1
        self.slo_log.append((now, kind, missed))
        self._slo_recent[kind][missed] += 1
        if len(self.slo_log) > SLO_LOG:
            self._forget_slo()

    def _forget_slo(self) -> None:
        _, kind, missed = self.slo_log.popleft()
        self._slo_recent[kind][missed] -= 1

    def _recent_slo(self, since: float) -> tuple[tuple[str, int, int], ...]:
        """(kind, met, missed) of the outcomes since `since`."""
        while self.slo_log and self.slo_log[0][0] < since:
            self._forget_slo()
        return tuple((k, met, missed) for k, (met, missed) in self._slo_recent.items())

    def snapshot(self) -> ModelSnapshot:
        a, s, lat = self.kv.allocator, self.scheduler, self.latency
        lay = self.kv.layout
        cached = a.num_cached_pages
        return ModelSnapshot(
            name=self.name,
            residency=self.residency,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            recomputed_tokens=s.recomputed_tokens,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            kv_blocks_prefix_idle=a.num_idle_blocks,
            shard_weight_bytes=tuple(
                (d, w.nbytes) for d, w in zip(self.shard_devices, self.weights.parts[1:])
            )
            if self.shard_devices
            else (),
            kv_pages_in_use=a.num_mapped_pages - cached,
            kv_pages_cached_free=cached,
            kv_blocks_used=a.num_used_blocks,
            kv_blocks_capacity=a.capacity_blocks,
            kv_block_bytes=lay.block_bytes * lay.num_layers,
            weight_pages=self.weights.pages.num_mapped_pages if self.weights else 0,
            weight_bytes=self.weight_bytes,
            pinned=self.pinned,
            activations=self.activations,
            evictions=self.evictions,
            activation_seconds=self.activation_seconds,
            last_activation_s=self.last_activation_s,
            bytes_activated=self.bytes_activated,
            last_used=self.last_used,
            state_since=self.state_since,
            last_eviction_s=self.last_eviction_s,
            activation_buckets=tuple(self.activation_buckets),
            overhead_bytes=self.overhead_bytes,
            requests_total=self.requests_total,
            num_deferred=min(self.num_deferred, len(s.waiting)),  # 0 once nothing waits
            ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s,
            slo_met=tuple((k, met, missed) for k, (met, missed) in self.slo.items()),
            slo_recent=self._recent_slo(time.monotonic() - SLO_WINDOW_S),
            transitions=tuple(self.transitions),
            latency=LatencySnapshot(
                prefill_1k_s=lat.prefill_s(1024),
                decode_b1_s=lat.decode_s(1, 1024),
                decode_b16_s=lat.decode_s(16, 16 * 1024),
                error=lat.error,
                profiled_shapes=len(lat.profile),
                observed_steps=lat.observed,
                coefficients=lat.coefficients,
            ),
        )

    def inherit_stats(self, old: ModelStats) -> None:
        """Take over the latency model, request count and SLO outcomes of the worker this model
        had on another device."""
        self.latency = old.latency
        for name in ("requests_total", "slo", "slo_log", "_slo_recent"):
            setattr(self, name, getattr(old, name))
