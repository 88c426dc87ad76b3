"""Prometheus metrics, named like vLLM's (prefix `prism:`, label `model_name`) so existing
dashboards work (every series vLLM's example Grafana dashboard queries exists, with vLLM's
meaning), plus Prism's own page-pool gauges and the process and GC collectors; no `_created`
series. Engine-state gauges come from the devices' published snapshots at scrape time (never from
engine-thread objects); request metrics are recorded by the frontend as outputs arrive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from scheduler.request import RequestOutput
from scheduler.snapshot import ACTIVATION_BUCKETS, DeviceSnapshot, Residency

disable_created_metrics()  # a `_created` series beside each counter doubles what is counted

# token counts: 1, 2, 5, 10, ... (vLLM's 1-2-5 buckets)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _SnapshotCollector:
    """Scrape-time gauges from the latest device snapshots."""

    def __init__(
        self, snapshots: Callable[[], Sequence[DeviceSnapshot]], plan=None, max_loras: int = 0
    ):
        self.snapshots = snapshots
        self.plan = plan  # () -> the control loop's last PlanView, or None
        self.max_loras = max_loras  # each base model's adapter slots

    def collect(self):
        running = GaugeMetricFamily(
            "prism:num_requests_running", "Requests in the running batch.", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "prism:num_requests_waiting", "Requests waiting to be scheduled.", labels=["model_name"]
        )
        usage = GaugeMetricFamily(
            "prism:kv_cache_usage_perc",
            "Fraction of the KV blocks the model can address in use.",
            labels=["model_name"],
        )
        pages = GaugeMetricFamily(
            "prism:model_kv_pages",
            "Pool pages mapped into the model's KV cache, by use.",
            labels=["model_name", "state"],
        )
        mbytes = GaugeMetricFamily(
            "prism:model_memory_bytes",
            "Device memory the model holds, by kind.",
            labels=["model_name", "kind"],
        )
        resident = GaugeMetricFamily(
            "prism:model_resident",
            "1 if the model's weights are on the device.",
            labels=["model_name"],
        )
        state = GaugeMetricFamily(
            "prism:model_state",
            "1 for the model's residency state.",
            labels=["model_name", "state"],
        )
        lm = ["model_name"]
        activations = CounterMetricFamily(
            "prism:model_activations", "Activations (weights copied in) since load.", labels=lm
        )
        evictions = CounterMetricFamily(
            "prism:model_evictions", "Evictions (weights unmapped) since load.", labels=lm
        )
        act_seconds = HistogramMetricFamily(
            "prism:model_activation_seconds",
            "Activation time, from the decision to map to the last byte landed.",
            labels=lm,
        )
        act_bytes = CounterMetricFamily(
            "prism:model_activation_bytes", "Bytes copied host to device by activations.", labels=lm
        )
        weight_pages = GaugeMetricFamily(
            "prism:model_weight_pages", "Pool pages mapped into the model's weights.", labels=lm
        )
        since = GaugeMetricFamily(
            "prism:model_state_since_seconds",
            "Seconds since the model entered its residency state.",
            labels=lm,
        )
        pool = GaugeMetricFamily(
            "prism:device_pool_pages",
            "Page pool of the device, by state.",
            labels=["device", "state"],
        )
        pbytes = GaugeMetricFamily(
            "prism:device_pool_bytes",
            "Bytes of the device's page pool, by state.",
            labels=["device", "state"],
        )
        policy = GaugeMetricFamily(
            "prism:policy_info", "The serving policy of each device.", labels=["device", "policy"]
        )
        estimate = GaugeMetricFamily(
            "prism:latency_estimate_seconds",
            "The latency model's step-time estimate, by step shape.",
            labels=lm + ["shape"],
        )
        est_error = GaugeMetricFamily(
            "prism:latency_estimate_error_ratio",
            "EWMA of |estimate - measured| / measured over the model's recent steps.",
            labels=lm,
        )
        deferred = GaugeMetricFamily(
            "prism:num_requests_deferred",
            "Waiting requests the arbitrator deferred (they would miss their TTFT deadline).",
            labels=lm,
        )
        deadlines = CounterMetricFamily(
            "prism:request_deadlines",
            "Requests that met or missed the deadlines the arbitrator scheduled by (configured "
            "SLOs, or derived from the latency model).",
            labels=lm + ["slo", "outcome"],
        )
        moved = CounterMetricFamily(
            "prism:page_moves_pages",
            "Pool pages moved from one model to another (taker empty: back to the pool).",
            labels=["device", "giver", "taker", "reason"],
        )
        preemptions = CounterMetricFamily(
            "prism:num_preemptions",
            "Requests preempted (their KV freed, recomputed later), since load (vLLM's name).",
            labels=lm,
        )
        recomputed = CounterMetricFamily(
            "prism:recomputed_tokens",
            "Computed tokens that preemptions threw away (computed again later), since load.",
            labels=lm,
        )
        queries = CounterMetricFamily(
            "prism:prefix_cache_queries",
            "Prompt tokens of new requests looked up in the prefix cache (vLLM's name).",
            labels=lm,
        )
        hits = CounterMetricFamily(
            "prism:prefix_cache_hits",
            "Prompt tokens found in the prefix cache, not computed (vLLM's name).",
            labels=lm,
        )
        lora = GaugeMetricFamily(
            "prism:lora_requests_info",
            "Per base model: its LoRA adapters with running and with waiting requests "
            "(vLLM's series, labels comma-separated; the value: when it was read, Unix time).",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        adapter_resident = GaugeMetricFamily(
            "prism:lora_adapter_resident",
            "1 if the LoRA adapter's weights are in its base's device memory (its pages mapped).",
            labels=["model_name", "base"],
        )
        for snap in self.snapshots():
            page = snap.pool.page_bytes
            policy.add_metric([snap.device, snap.policy], 1)
            for giver, taker, reason, n in snap.moved:
                moved.add_metric([snap.device, giver, taker, reason], n)
            for m in snap.models:
                name = m.name
                lat = m.latency
                estimate.add_metric([name, "prefill_1k"], lat.prefill_1k_s)
                estimate.add_metric([name, "decode_b1_ctx1k"], lat.decode_b1_s)
                estimate.add_metric([name, "decode_b16_ctx1k"], lat.decode_b16_s)
                if lat.error is not None:
                    est_error.add_metric([name], lat.error)
                deferred.add_metric([name], m.num_deferred)
                preemptions.add_metric([name], m.num_preemptions)
                recomputed.add_metric([name], m.recomputed_tokens)
                queries.add_metric([name], m.prefix_cache_queries)
                hits.add_metric([name], m.prefix_cache_hits)
                mbytes.add_metric(
                    [name, "kv_prefix_idle"], m.kv_blocks_prefix_idle * m.kv_block_bytes
                )
                for kind, met, missed in m.slo_met:
                    deadlines.add_metric([name, kind, "met"], met)
                    deadlines.add_metric([name, kind, "missed"], missed)
                running.add_metric([name], m.num_running)
                waiting.add_metric([name], m.num_waiting)
                usage.add_metric([name], m.kv_usage)
                pages.add_metric([name, "in_use"], m.kv_pages_in_use)
                pages.add_metric([name, "cached_free"], m.kv_pages_cached_free)
                mbytes.add_metric([name, "kv_used"], m.kv_blocks_used * m.kv_block_bytes)
                mbytes.add_metric([name, "kv_mapped"], m.kv_pages * page)
                mbytes.add_metric([name, "kv_cached_free"], m.kv_pages_cached_free * page)
                mbytes.add_metric([name, "weights"], m.weight_pages * page)
                mbytes.add_metric([name, "overhead"], m.overhead_bytes)
                resident.add_metric([name], 1 if m.residency.on_device else 0)
                for r in Residency:
                    state.add_metric([name, r.value], 1 if m.residency is r else 0)
                since.add_metric([name], max(snap.time - m.state_since, 0.0))
                activations.add_metric([name], m.activations)
                evictions.add_metric([name], m.evictions)
                buckets, total = [], 0
                for le, n in zip(ACTIVATION_BUCKETS, m.activation_buckets):
                    total += n
                    buckets.append((floatToGoString(le), total))
                act_seconds.add_metric([name], buckets, m.activation_seconds)
                act_bytes.add_metric([name], m.bytes_activated)
                weight_pages.add_metric([name], m.weight_pages)
                if m.adapters:
                    busy = [a.name for a in m.adapters if a.num_running]
                    queued = [a.name for a in m.adapters if a.num_waiting]
                    labels = [name, str(self.max_loras), ",".join(busy), ",".join(queued)]
                    lora.add_metric(labels, time.time())
                for a in m.adapters:  # an adapter: a model_name of its own (its base's counts
                    running.add_metric([a.name], a.num_running)  # include its requests)
                    waiting.add_metric([a.name], a.num_waiting)
                    resident.add_metric([a.name], 1 if a.resident else 0)
                    weight_pages.add_metric([a.name], a.weight_pages)
                    mbytes.add_metric([a.name, "weights"], a.weight_pages * page)
                    activations.add_metric([a.name], a.activations)
                    evictions.add_metric([a.name], a.evictions)
                    adapter_resident.add_metric([a.name, name], 1 if a.resident else 0)
            p, dev = snap.pool, snap.device
            pool.add_metric([dev, "capacity"], p.capacity)
            pool.add_metric([dev, "created"], p.created)
            pool.add_metric([dev, "free"], p.free)
            pool.add_metric([dev, "owned"], p.owned)
            pbytes.add_metric([dev, "capacity"], p.capacity * page)
            pbytes.add_metric([dev, "owned"], p.owned * page)
            pbytes.add_metric([dev, "free"], p.free * page)
        yield from (running, waiting, usage, pages, mbytes, resident, state, pool, pbytes)
        yield from (activations, evictions, act_seconds, act_bytes, weight_pages, since)
        yield from (policy, estimate, est_error, deferred, deadlines, moved, queries, hits)
        yield from (preemptions, recomputed, lora, adapter_resident)
        view = self.plan() if self.plan is not None else None
        if view is not None:
            kvpr = GaugeMetricFamily(
                "prism:device_kvpr",
                "The planner's KV pressure ratio: demand over the KV room beside the weights "
                "(per GiB).",
                labels=["device"],
            )
            for dev, v in view.placement.kvpr.items():
                kvpr.add_metric([dev], v * (1 << 30) if v != float("inf") else v)
            rate = GaugeMetricFamily(
                "prism:model_request_rate", "EWMA request rate (requests/s).", labels=lm
            )
            demand = GaugeMetricFamily(
                "prism:model_demand", "Request rate over TTFT SLO (the planner's d_i).", labels=lm
            )
            for name, r in view.rates.items():
                rate.add_metric([name], r)
                demand.add_metric([name], view.demand[name])
            yield from (kvpr, rate, demand)


class Metrics:
    def __init__(
        self, snapshots: Callable[[], Sequence[DeviceSnapshot]], plan=None, max_loras: int = 0
    ):
        self.registry = r = CollectorRegistry()
        r.register(_SnapshotCollector(snapshots, plan, max_loras))
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(c)  # the default registry's: the process's CPU, memory, files, GC
        lm = ["model_name"]
        self.prompt_tokens = Counter(
            "prism:prompt_tokens", "Prefill tokens processed.", lm, registry=r
        )
        self.generation_tokens = Counter(
            "prism:generation_tokens", "Tokens generated.", lm, registry=r
        )
        self.request_success = Counter(
            "prism:request_success", "Finished requests.", lm + ["finished_reason"], registry=r
        )

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, lm, buckets=_LATENCY_BUCKETS, registry=r)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, lm, buckets=_TOKEN_BUCKETS, registry=r)

        self.ttft = seconds("prism:time_to_first_token_seconds", "Time to first token.")
        self.itl = seconds("prism:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = seconds("prism:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = seconds("prism:request_queue_time_seconds", "Arrival to first scheduled.")
        self.tpot = seconds(
            "prism:time_per_output_token_seconds",
            "Time per output token: each gap between output tokens (vLLM's v0 name).",
        )
        self.request_tpot = seconds(
            "prism:request_time_per_output_token_seconds",
            "A finished request's mean time per output token (first to last token over n - 1).",
        )
        self.prefill_time = seconds(
            "prism:request_prefill_time_seconds", "First scheduled to first token (prefill)."
        )
        self.decode_time = seconds(
            "prism:request_decode_time_seconds", "First token to last token (decode)."
        )
        self.inference_time = seconds(
            "prism:request_inference_time_seconds", "First scheduled to last token (running)."
        )
        self.request_prompt_tokens = tokens(
            "prism:request_prompt_tokens", "Prompt tokens of each finished request."
        )
        self.request_generation_tokens = tokens(
            "prism:request_generation_tokens", "Tokens generated by each finished request."
        )
        self.request_max_generation_tokens = tokens(
            "prism:request_max_num_generation_tokens",
            "The most tokens one sequence of a finished request generated (one per request: each "
            "of n choices is its own).",
        )
        self.request_max_tokens = tokens(
            "prism:request_params_max_tokens", "The max_tokens each finished request asked for."
        )
        self.slo = Counter(
            "prism:slo",
            "Requests that met or missed their SLO.",
            lm + ["slo", "outcome"],
            registry=r,
        )
        self.pending = Gauge(
            "prism:num_requests_pending",
            "Accepted requests that have not produced output yet (queued, or in prefill).",
            lm,
            registry=r,
        )
        self.rejected = Counter(
            "prism:requests_rejected",
            "Requests refused before running.",
            lm + ["reason"],
            registry=r,
        )
        self.wait_seconds = Counter(
            "prism:request_wait_seconds",
            "Seconds of ended requests by where they went (offloaded, activation, kv, "
            "other_models, queue, prefill, decode, decode_other_models, preempted).",
            lm + ["cause"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- one request's life (the frontend calls these on the event loop) -----------------------
    def started(
        self, model: str, out: RequestOutput, arrival: float, now: float, ttft_slo_ms
    ) -> None:
        """The request's first output arrived (its first token, or its end)."""
        self.pending.labels(model).dec()
        self.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
        if out.first_scheduled_time is not None:
            self.queue_time.labels(model).observe(max(out.first_scheduled_time - arrival, 0.0))
        if out.new_token_ids:
            ttft = now - arrival
            self.ttft.labels(model).observe(ttft)
            if ttft_slo_ms:
                met = ttft * 1000 <= ttft_slo_ms
                self.slo.labels(model, "ttft", "met" if met else "missed").inc()

    def waited(self, model: str, waits: dict[str, float]) -> None:
        """A request ended: its seconds by cause (scheduler.request.WAIT_CAUSES)."""
        for cause, seconds in waits.items():
            self.wait_seconds.labels(model, cause).inc(max(seconds, 0.0))

    def tokens(self, model: str, n: int, gap: float | None) -> None:
        """n tokens arrived, `gap` seconds after the previous ones (None for the first)."""
        if gap is not None:
            self.itl.labels(model).observe(gap)
            self.tpot.labels(model).observe(gap)
        self.generation_tokens.labels(model).inc(n)

    def finished(
        self,
        model: str,
        out: RequestOutput,
        arrival: float,
        first: float | None,
        now: float,
        tpot_slo_ms,
        scheduled: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """scheduled: when it first ran (None: never); max_tokens: what it asked for."""
        self.e2e.labels(model).observe(now - arrival)
        self.request_success.labels(model, out.finish_reason.value).inc()
        self.request_prompt_tokens.labels(model).observe(out.num_prompt_tokens)
        self.request_generation_tokens.labels(model).observe(out.num_output_tokens)
        self.request_max_generation_tokens.labels(model).observe(out.num_output_tokens)
        if max_tokens is not None:
            self.request_max_tokens.labels(model).observe(max_tokens)
        if scheduled is not None:
            self.inference_time.labels(model).observe(max(now - scheduled, 0.0))
            self.prefill_time.labels(model).observe(max((first or now) - scheduled, 0.0))
        if first is not None:
            self.decode_time.labels(model).observe(now - first)
        if first is not None and out.num_output_tokens > 1:
            tpot = (now - first) / (out.num_output_tokens - 1)
            self.request_tpot.labels(model).observe(tpot)
            if tpot_slo_ms:
                met = tpot * 1000 <= tpot_slo_ms
                self.slo.labels(model, "tpot", "met" if met else "missed").inc()
