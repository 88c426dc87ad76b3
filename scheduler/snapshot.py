"""What the engine thread publishes after each step: immutable, plain data.

The HTTP side (routes, /metrics), and the coming status view and control loop, read these and
never the engine thread's live objects. Built by the device worker; consumed by anyone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Residency(str, enum.Enum):
    """offloaded -> activating -> resident -> draining -> offloaded; failed is terminal."""

    OFFLOADED = "offloaded"  # weights only in the host copy; a request activates it
    ACTIVATING = "activating"  # weight pages mapped, the host-to-device copy in flight
    RESIDENT = "resident"  # weights on the device, serving
    DRAINING = "draining"  # admits nothing new; running requests finish (or are requeued)
    FAILED = "failed"  # could not be loaded; requests get 503

    @property
    def on_device(self) -> bool:
        """Whether its weight pages are mapped (it holds device memory)."""
        return self in (Residency.ACTIVATING, Residency.RESIDENT, Residency.DRAINING)


# upper bounds (seconds) of the activation-time histogram each ModelSnapshot carries
ACTIVATION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, float("inf"))


@dataclass(frozen=True)
class LatencySnapshot:
    """What the model's latency model predicts now, and how wrong it has been."""

    prefill_1k_s: float = 0.0  # a 1,024-token prompt
    decode_b1_s: float = 0.0  # a decode step of 1 sequence over 1,024 tokens of context
    decode_b16_s: float = 0.0  # 16 sequences of 1,024 tokens each
    error: float | None = None  # EWMA of |estimate - measured| / measured over recent steps
    profiled_shapes: int = 0
    observed_steps: int = 0
    # the fitted step cost (LatencyModel's c0, per token, per sequence, per 1k attention pairs):
    # with these a bench replays a run's decisions in the device simulator
    coefficients: tuple[float, ...] = ()


@dataclass(frozen=True)
class AdapterSnapshot:
    """A LoRA adapter served by its base's steps (ModelSnapshot.adapters of the base)."""

    name: str
    base: str
    path: str
    rank: int
    resident: bool  # its weight pages mapped (only while its base is on the device)
    slot: int | None  # its base's adapter slot (None: none now)
    weight_bytes: int
    weight_pages: int  # pool pages mapped for it now
    activating: bool = False  # its activation's copy in flight (its requests wait)
    num_running: int = 0
    num_waiting: int = 0
    requests_total: int = 0
    activations: int = 0
    evictions: int = 0
    last_used: float = 0.0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def residency(self) -> str:
        """As /v1/models and the status view name it: its copy in flight (activating), its
        pages mapped (resident), or in its host copy only (offloaded)."""
        if self.activating:
            return Residency.ACTIVATING.value
        return (Residency.RESIDENT if self.resident else Residency.OFFLOADED).value


@dataclass(frozen=True)
class ModelSnapshot:
    name: str
    residency: Residency
    num_running: int  # in the running batch
    num_waiting: int  # queued in the batch scheduler
    num_preemptions: int  # since load
    kv_pages_in_use: int  # pool pages mapped into the KV cache holding at least one used block
    kv_pages_cached_free: int  # mapped, every block free: the model's reserve for its next burst
    kv_blocks_used: int
    kv_blocks_capacity: int  # blocks the model could hold with every page it can address
    kv_block_bytes: int  # one block over all layers (K and V)
    weight_pages: int  # pool pages holding weights
    weight_bytes: int
    pinned: bool = False  # never evicted
    activations: int = 0  # since load
    evictions: int = 0
    activation_seconds: float = 0.0  # total time spent activating
    last_activation_s: float | None = None
    bytes_activated: int = 0  # host -> device bytes, total
    last_used: float = 0.0  # when it last ran a step or was activated (time.monotonic())
    state_since: float = 0.0  # when it entered `residency` (time.monotonic())
    last_eviction_s: float | None = None  # the last drain + unmap, from the evict decision
    # activations per ACTIVATION_BUCKETS bucket (not cumulative)
    activation_buckets: tuple[int, ...] = (0,) * len(ACTIVATION_BUCKETS)
    overhead_bytes: int = 0  # device memory it holds outside the pool (graphs, buffers)
    requests_total: int = 0  # queued on it since load
    num_deferred: int = 0  # waiting requests the arbitrator last deferred (would be late)
    ttft_slo_s: float | None = None  # configured (None: derived per request)
    tpot_slo_s: float | None = None
    # finished requests that met / missed their SLOs (TTFT at the first token, TPOT at the end)
    slo_met: tuple[tuple[str, int, int], ...] = ()  # (kind, met, missed)
    slo_recent: tuple[tuple[str, int, int], ...] = ()  # the same over the last minute
    # the latest residency changes, oldest first: (when it entered, the state entered)
    transitions: tuple[tuple[float, Residency], ...] = ()
    latency: LatencySnapshot = LatencySnapshot()
    # the prefix cache: prompt tokens of new requests looked up / found, since load; cached
    # blocks no request uses (counted in kv_blocks_used: reclaimed first under pressure)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_prefix_idle: int = 0
    # a model split over several devices: the weight bytes of its shards on the other devices,
    # (device, bytes); weight_bytes counts them too
    shard_weight_bytes: tuple[tuple[str, int], ...] = ()
    recomputed_tokens: int = 0  # computed tokens preemptions threw away, since load
    adapters: tuple[AdapterSnapshot, ...] = ()  # its LoRA adapters

    @property
    def kv_blocks_held(self) -> int:
        """Blocks requests hold (the used ones but the idle cached)."""
        return self.kv_blocks_used - self.kv_blocks_prefix_idle

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_pages(self) -> int:
        return self.kv_pages_in_use + self.kv_pages_cached_free

    @property
    def kv_usage(self) -> float:
        """Fraction of the addressable KV blocks requests hold (idle cached blocks count as
        free, as vLLM counts them: they go first when blocks are needed)."""
        return self.kv_blocks_held / max(self.kv_blocks_capacity, 1)


@dataclass(frozen=True)
class PoolSnapshot:
    page_bytes: int
    capacity: int  # pages the budget allows (the shared null page excluded)
    created: int
    free: int  # created, owned by nobody
    owned: int


@dataclass(frozen=True)
class PageMove:
    """Pages that went from one model to another (taker None: back to the pool), and why:
    "reserve" (cached KV pages reclaimed for another's grant), "evict" (a whole model evicted
    for another), "keep-alive" (idle past its keep-alive, or at once under `swap`)."""

    seq: int
    time: float
    giver: str
    taker: str | None
    pages: int
    reason: str


@dataclass(frozen=True)
class EngineCounters:
    """What the device's engine thread has done since it started."""

    steps: int = 0  # model steps run
    step_seconds: float = 0.0  # in model steps (host preparation, the device's work, sampling)
    host_seconds: float = 0.0  # between back-to-back steps (scheduling, publishing)
    step_overhead_s: float = 0.0  # the recent host time between two steps (an EWMA)


@dataclass(frozen=True)
class DeviceSnapshot:
    device: str
    seq: int  # increases with every publication
    time: float  # when it was taken (time.monotonic())
    pool: PoolSnapshot
    models: tuple[ModelSnapshot, ...]
    policy: str = "prism"
    moves: tuple[PageMove, ...] = ()  # the latest page moves, oldest first
    moved: tuple[tuple[str, str, str, int], ...] = ()  # (giver, taker or "", reason, pages) in all
    engine: EngineCounters = EngineCounters()

    def model(self, name: str) -> ModelSnapshot | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def has_requests(self) -> bool:
        return any(m.num_requests for m in self.models)
