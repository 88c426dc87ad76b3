"""One device's decisions replayed in simulated time: the batch schedulers, the arbitrator and
the requests' deadlines exactly as the engine runs them, with each step lasting what a latency
model says. It answers "what would these decisions do to these SLOs on this device" in
milliseconds, without a GPU, so a change to a decision can be tried on a trace (with step costs
measured on the device) before it meets the device.

Pure: no clock, no torch; every model's KV is a plain block count: unbounded by default (no
memory pressure), or a fixed number of blocks (`SimModel.kv_blocks`: a static partition's quota).
A step lasts exactly its cost model's figure, unless `noise` draws each step's ratio to it (the
device's own scatter around its fit: what the arbitrator's estimates cannot know)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from scheduler.arbitrator import arbitrate, model_work
from scheduler.batch_scheduler import BatchScheduler, SchedulerConfig
from scheduler.latency_model import LatencyModel, StepShape
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

# a step's seconds over its cost model's figure, drawn per step: (model, the step's shape) -> ratio
StepNoise = Callable[[str, StepShape], float]


@dataclass(frozen=True)
class SimModel:
    name: str
    device_latency: LatencyModel  # how long its steps take on the simulated device
    ttft_slo_s: float
    tpot_slo_s: float
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    # what the arbitrator believes (None: the device's own model, a perfect estimate)
    estimate: LatencyModel | None = None
    kv_blocks: int | None = None  # its KV room in blocks (None: unbounded)


@dataclass(frozen=True)
class SimArrival:
    time: float
    model: str
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class SimResult:
    arrival: SimArrival
    ttft_s: float
    tpot_s: float | None  # mean over its decode tokens (None: one token)
    max_gap_s: float  # its longest wait between two tokens
    met_ttft: bool
    met_tpot: bool


@dataclass(frozen=True)
class SimStep:
    start: float
    seconds: float
    model: str
    prefill_tokens: int
    decodes: int


class _Blocks:
    """A KV block pool of `capacity` blocks (None: it never runs out)."""

    def __init__(self, capacity: int | None = None):
        self.capacity_blocks = capacity if capacity is not None else 1 << 30
        self.bounded = capacity is not None
        self.used = 0
        self._next = 1

    def allocate(self, n: int) -> list[int] | None:
        if not self.can_allocate(n):
            return None
        out = list(range(self._next, self._next + n))
        self._next += n
        self.used += n
        return out

    def can_allocate(self, n: int) -> bool:
        return not self.bounded or self.used + n <= self.capacity_blocks

    def free(self, blocks: list[int]) -> None:
        self.used -= len(blocks)


@dataclass
class Simulation:
    results: list[SimResult]
    steps: list[SimStep]

    def attainment(self) -> float:
        """The fraction of requests meeting both SLOs."""
        if not self.results:
            return 1.0
        return sum(r.met_ttft and r.met_tpot for r in self.results) / len(self.results)


def simulate(
    models: Iterable[SimModel],
    arrivals: Iterable[SimArrival],
    overhead_s: float = 0.0,
    noise: StepNoise | None = None,
) -> Simulation:
    """Replays the arrivals on one device whose models are `models`; overhead_s: the host time
    between two steps; noise: each step's ratio to its cost (None: 1). Every request runs to its
    output length."""
    specs = {m.name: m for m in models}
    scheds = {n: BatchScheduler(m.config, _Blocks(m.kv_blocks)) for n, m in specs.items()}
    pending = sorted(arrivals, key=lambda a: (a.time, a.model))
    origin: dict[str, tuple[SimArrival, list[float]]] = {}  # request id -> arrival, token times
    results: list[SimResult] = []
    steps: list[SimStep] = []
    now, nxt = 0.0, 0
    while nxt < len(pending) or any(s.has_work for s in scheds.values()):
        while nxt < len(pending) and pending[nxt].time <= now:
            a = pending[nxt]
            spec = specs[a.model]
            if not scheds[a.model].fits(a.prompt_len + a.output_len):
                raise ValueError(f"a request of {a.model} can never fit its KV room: {a}")
            req = Request(
                f"r{nxt}",
                [1] * a.prompt_len,
                SamplingParams(max_tokens=a.output_len, ignore_eos=True),
                frozenset(),
                a.time,
            )
            req.ttft_slo, req.tpot_slo = spec.ttft_slo_s, spec.tpot_slo_s
            scheds[a.model].add(req)
            origin[req.request_id] = (a, [])
            nxt += 1
        works = [
            model_work(n, s, specs[n].estimate or specs[n].device_latency)
            for n, s in scheds.items()
            if s.has_work
        ]
        batch, pick = [], None
        while works and not batch:  # a model whose KV room is full cannot step: the next one
            pick = arbitrate(works, now, overhead_s)
            if pick is None:
                break
            batch = scheds[pick.model].schedule(now, pick.admit, pick.token_budget)
            if not batch and specs[pick.model].kv_blocks is None:
                raise RuntimeError(f"the arbitrator picked {pick.model}, which could not step")
            works = [w for w in works if w.name != pick.model]
        if not batch:  # nothing can step: time passes to the next arrival
            if nxt >= len(pending):
                raise RuntimeError("no model can step and no request is left to arrive")
            now = max(now, pending[nxt].time)
            continue
        sched = scheds[pick.model]
        shape = StepShape.of((c.start, c.num_new) for c in batch)
        seconds = specs[pick.model].device_latency.estimate(shape)
        if noise is not None:
            seconds *= noise(pick.model, shape)
        steps.append(
            SimStep(
                now,
                seconds,
                pick.model,
                sum(c.num_new for c in batch if c.num_new > 1 or not c.samples),
                sum(1 for c in batch if c.num_new == 1 and c.samples),
            )
        )
        now += seconds
        sched.advance(batch)
        for c in batch:
            if not c.samples:
                continue
            req = c.request
            req.append_token(0)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            a, times = origin[req.request_id]
            times.append(now)
            if req.num_output_tokens >= a.output_len:
                sched.finish(req)
                results.append(_result(a, times, specs[a.model]))
        now += overhead_s
    return Simulation(results, steps)


def _result(a: SimArrival, times: list[float], spec: SimModel) -> SimResult:
    ttft = times[0] - a.time
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    gaps = [b - x for x, b in zip(times, times[1:])]
    return SimResult(
        a,
        ttft,
        tpot,
        max(gaps, default=0.0),
        ttft <= spec.ttft_slo_s,
        tpot is None or tpot <= spec.tpot_slo_s,
    )
