"""Prometheus metrics, named like vLLM's (prefix `prism:`, label `model_name`) so existing
dashboards work, plus Prism's own page-pool gauges. Engine-state gauges are read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from prism_server.engine import Engine

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


class _EngineCollector:
    """Scrape-time gauges from the engine's schedulers, KV caches and page pool."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
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
            "prism:model_resident", "1 if the model is resident.", labels=["model_name"]
        )
        for name, m in list(e.models.items()):
            alloc = m.kv_cache.allocator
            running.add_metric([name], len(m.scheduler.running))
            waiting.add_metric([name], len(m.scheduler.waiting))
            usage.add_metric([name], alloc.num_used_blocks / max(alloc.capacity_blocks, 1))
            cached = alloc.num_cached_pages
            pages.add_metric([name, "in_use"], alloc.num_mapped_pages - cached)
            pages.add_metric([name, "cached_free"], cached)
            page = e.pool.page_bytes
            used = alloc.num_used_blocks * alloc.layout.block_bytes * alloc.layout.num_layers
            mbytes.add_metric([name, "kv_used"], used)
            mbytes.add_metric([name, "kv_mapped"], alloc.num_mapped_pages * page)
            mbytes.add_metric([name, "kv_cached_free"], cached * page)
            mbytes.add_metric([name, "weights"], m.weight_bytes)
            resident.add_metric([name], 1)
        s = e.pool.stats()
        dev = str(e.device)
        pool = GaugeMetricFamily(
            "prism:device_pool_pages",
            "Page pool of the device, by state.",
            labels=["device", "state"],
        )
        pool.add_metric([dev, "capacity"], s.capacity)
        pool.add_metric([dev, "created"], s.created)
        pool.add_metric([dev, "free"], s.free)
        pool.add_metric([dev, "owned"], sum(s.owned.values()))
        pbytes = GaugeMetricFamily(
            "prism:device_pool_bytes",
            "Bytes of the device's page pool, by state.",
            labels=["device", "state"],
        )
        pbytes.add_metric([dev, "capacity"], s.capacity * s.page_bytes)
        pbytes.add_metric([dev, "owned"], sum(s.owned.values()) * s.page_bytes)
        pbytes.add_metric([dev, "free"], s.free * s.page_bytes)
        yield from (running, waiting, usage, pages, mbytes, resident, pool, pbytes)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
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
        self.ttft = Histogram(
            "prism:time_to_first_token_seconds",
            "Time to first token.",
            lm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "prism:inter_token_latency_seconds",
            "Time between output tokens.",
            lm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "prism:e2e_request_latency_seconds",
            "Arrival to last token.",
            lm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "prism:request_queue_time_seconds",
            "Arrival to first scheduled.",
            lm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
