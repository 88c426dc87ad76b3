"""The arbitrator of one device: which model's batch runs next, which waiting requests it admits,
and how many tokens its step may compute.

The device runs one model's batch at a time. Each request carries a deadline: a waiting request
its TTFT deadline (arrival + TTFT SLO); a running one its next-token deadline (last token + TPOT
SLO, or its TTFT deadline until its first token).

- Admission (all models of the device at once): Moore-Hodgson over the waiting requests, each
  taking its estimated prefill time: in deadline order, and whenever the sequence would finish a
  request late, drop the longest one admitted so far. The kept set is the largest set of requests
  that can all meet their TTFT deadlines run one after the other; the dropped ones are deferred
  (admitted once no on-time request of another model waits, then served like any other work, so
  a late request is late, not starved behind other models' decodes; the frontend gives them 503
  + Retry-After past their hold limit). Ties in deadline go to the lower `priority` value (vLLM's
  convention), then the earlier arrival.
- Which model: when some model would miss a deadline if another model's step ran first, the one
  with the least slack runs (latest start = deadline - its step; a first token at stake before
  a stream whose mean TPOT can absorb one gap up to its cap; a stream behind its mean that
  cannot catch up, its step being no faster than its SLO, has no deadline left: it takes its
  turn like a late request instead of holding the device for as long as it lasts); otherwise
  the model whose prompts must go on soonest (least laxity over its prefills in progress, then
  its on-time waiting prompts, each after those before it), so that a long prompt with a loose
  SLO makes way for tighter ones instead of running first because it came first; with no
  prompt work, the model whose work has waited longest (FCFS across models). Moore-Hodgson
  counts the prefills in progress as committed work ahead of the prompts behind them.
- Chunking: the chosen model's step may take no longer than the slack of every decoding request
  on the device (its own: the step must end by their next-token deadline; other models': by
  their deadline less their own next step), so another model's long prompt is prefilled in
  chunks between their decode steps instead of making them late. Likewise it must end by the
  latest start of another model's on-time prompt (waiting, or part-way through its chunked
  prefill), so a long prompt in progress does not make a short one with a tight TTFT late. A
  late prefill is not a limit (smaller chunks would only make it later), nor are decodes that
  would be late even beside no prefill at all.

Pure: plain data in, a Pick out; `now` passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.batch_scheduler import BatchScheduler
from scheduler.latency_model import LatencyModel, StepShape
from scheduler.request import MAX_GAP_SLOS, TPOT_MARGIN, Request

SAFETY = 0.1  # a chunk is sized to its slack / (1 + max(estimate error, SAFETY))


@dataclass(frozen=True)
class Job:
    """A waiting request as the arbitrator sees it."""

    key: str
    model: str
    arrival: float
    deadline: float  # its TTFT deadline
    duration: float  # estimated prefill seconds
    priority: int = 0  # lower runs first among equal deadlines
    cached: int = 0  # prompt tokens already in its KV (recompute after preemption: 0)
    tokens: int = 1  # prompt tokens to prefill


def _edf_key(j: Job):
    return (j.deadline, j.priority, j.arrival, j.key)


def moore_hodgson(
    jobs: Sequence[Job], start: float, fixed: Sequence[Job] = ()
) -> tuple[list[Job], list[Job]]:
    """(on time in deadline order, late in deadline order) for jobs run one after the other from
    `start`: the on-time set is as large as any sequence of these jobs can make it. `fixed`:
    work already committed (prefills in progress) that takes its place in the sequence by its
    deadline, is never dropped and never judged late, but delays every job after it."""
    ordered = sorted(
        [(_edf_key(j), False, j) for j in jobs] + [(_edf_key(j), True, j) for j in fixed]
    )
    kept: list[Job] = []
    longest: list[tuple] = []  # max-heap by duration over the droppable of `kept`
    late: list[Job] = []
    t = start
    for _, is_fixed, j in ordered:
        t += j.duration
        if is_fixed:
            continue
        kept.append(j)
        # the longest goes first; among equals the least important, then the latest
        heapq.heappush(longest, (-j.duration, -j.priority, -j.arrival, _neg(j.key), j))
        while t > j.deadline and longest:  # (one drop does, unless fixed work is late)
            *_, drop = heapq.heappop(longest)
            kept.remove(drop)
            late.append(drop)
            t -= drop.duration
    return kept, sorted(late, key=_edf_key)


class _neg(str):
    """A string that sorts in reverse (for the max-heap's last tie-break)."""

    def __lt__(self, other):
        return str.__gt__(self, other)


@dataclass(frozen=True)
class Running:
    """What the running requests of one model need next."""

    # the earliest next-token deadline of the decoding ones: what a prefill chunk must respect
    # (a late prefill is not helped by smaller chunks)
    decode_deadline: float | None = None
    # the earliest gap cap of the decoding ones (latest token + MAX_GAP_SLOS x its TPOT SLO):
    # what a prefill chunk must respect when its own first token is at stake (a stream's mean
    # TPOT absorbs one long gap; a TTFT missed is missed)
    decode_gap_deadline: float | None = None
    # the TPOT SLO of the decoding one due first (at decode_deadline)
    tpot_slo: float | None = None
    ready_since: float | None = None  # when the oldest of them became ready to step
    num: int = 0  # decoding (one token a step)
    context_tokens: int = 0  # KV tokens the decoding ones attend
    # KV tokens of the oldest admitted request still in (chunked) prefill (its next chunk
    # attends them)
    prefill_cached: int = 0
    # each of those requests in TTFT-deadline order: (deadline, prompt tokens left, tokens
    # cached, the seconds its latency model gives the rest of its prefill)
    prefills: tuple[tuple[float, int, int, float], ...] = ()

    @property
    def prefilling(self) -> int:
        """Admitted requests still in (chunked) prefill."""
        return len(self.prefills)

    @property
    def any(self) -> bool:
        return bool(self.num or self.prefilling)


@dataclass(frozen=True)
class ModelWork:
    name: str
    latency: LatencyModel
    running: Running
    waiting: tuple[Job, ...] = ()
    max_tokens: int = 2048  # its step's token limit (max_num_batched_tokens)
    min_tokens: int = 16  # the smallest prefill chunk worth a step (progress is guaranteed)

    @property
    def base(self) -> StepShape:
        r = self.running
        return StepShape.decode(r.num, r.context_tokens) if r.num else StepShape()

    @property
    def decode_s(self) -> float:
        return self.latency.estimate(self.base) if self.running.num else 0.0


def model_work(name: str, sched: BatchScheduler, lat: LatencyModel) -> ModelWork:
    """What the arbitrator needs of one model: its waiting requests as jobs (their prefill
    estimated by its latency model, in the chunks its step's token limit cuts it into) and
    what its running ones need next."""
    chunk = sched.config.max_num_batched_tokens
    jobs = []
    for r in sched.waiting:
        cached, todo = r.num_computed_tokens, r.num_tokens - r.num_computed_tokens
        jobs.append(
            Job(
                r.request_id,
                name,
                r.arrival_time,
                r.deadline,
                lat.chunked_prefill_s(todo, cached, chunk),
                r.priority,
                cached,
                todo,
            )
        )
    running = Running()
    if sched.running:
        decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
        first = min(decoding, key=lambda r: r.deadline, default=None)
        running = Running(
            decode_deadline=first.deadline if first else None,
            tpot_slo=first.tpot_slo if first else None,
            decode_gap_deadline=min(
                (
                    r.last_token_time + MAX_GAP_SLOS * r.tpot_slo
                    for r in decoding
                    if r.last_token_time is not None and r.tpot_slo is not None
                ),
                default=None,
            ),
            ready_since=min(r.last_token_time or r.arrival_time for r in sched.running),
            num=len(decoding),
            context_tokens=sum(r.num_computed_tokens for r in decoding),
            prefill_cached=prefilling[0].num_computed_tokens if prefilling else 0,
            prefills=tuple(sorted(_prefill_left(r, lat, chunk) for r in prefilling)),
        )
    cfg = sched.config
    floor = max(16, cfg.block_size, lat.knee_tokens())  # the smallest chunk worth a step
    return ModelWork(
        name,
        lat,
        running,
        tuple(jobs),
        max_tokens=cfg.max_num_batched_tokens,
        min_tokens=min(cfg.max_num_batched_tokens, floor),
    )


@dataclass(frozen=True)
class Pick:
    model: str
    admit: tuple[str, ...]  # waiting keys to admit, in this order (on time, then deferred)
    token_budget: int
    deferred: tuple[str, ...] = ()  # every deferred key on the device


def arbitrate(models: Sequence[ModelWork], now: float, overhead_s: float = 0.0) -> Pick | None:
    """The next step of the device, or None if no model has work. overhead_s: the device's host
    time between two steps (scheduling, publishing), which every step pays beside its own."""
    active = [m for m in models if m.running.any or m.waiting]
    if not active:
        return None
    jobs = [j for m in active for j in m.waiting]
    on_time, late = moore_hodgson(jobs, now, _in_progress(active))
    mine: dict[str, list[Job]] = {}  # each model's on-time prompts, in deadline order
    for j in on_time:
        mine.setdefault(j.model, []).append(j)
    first_on_time = {name: jobs[0] for name, jobs in mine.items()}
    # the shortest step each could take (its decodes, a min_tokens chunk): what another model
    # must wait for at least, since longer prefills are chunked to its slack
    min_step_s = {
        m.name: _step_estimate(m, first_on_time.get(m.name), m.min_tokens) for m in active
    }

    # when each model's prompts (in progress, then its on-time waiting ones) must go on
    prompt_start = {m.name: _prompt_start_by(m, mine.get(m.name, ()), now) for m in active}

    def start_by(m: ModelWork, due: float | None) -> float:
        """When m must step: its running requests due by `due` need their next step (the
        decodes and the smallest chunk; the rest of a prefill in progress is
        _prompt_start_by's), its prompts by prompt_start."""
        starts = [] if due is None else [due - min_step_s[m.name]]
        if prompt_start[m.name] is not None:
            starts.append(prompt_start[m.name])
        return min(starts, default=float("inf"))

    def latest_start(m: ModelWork) -> float:
        return start_by(m, _decode_due(m, now, overhead_s))

    def urgent(m: ModelWork) -> bool:
        others = max(
            (min_step_s[o.name] * (1 + _err(o)) for o in active if o is not m), default=0.0
        )
        return latest_start(m) - now < others + overhead_s

    on_time_keys = {j.key for j in on_time}

    def ready_since(m: ModelWork) -> float:
        times = [j.arrival for j in m.waiting if j.key in on_time_keys]
        if m.running.ready_since is not None:
            times.append(m.running.ready_since)
        return min(times or [j.arrival for j in m.waiting] or [float("inf")])

    # a model with only deferred requests competes once no on-time request waits anywhere
    # (work conserving: running decodes elsewhere do not hold it back; their deadlines make
    # them urgent when they must go first, and the chunk budget protects them)
    candidates = [m for m in active if m.running.any or m.name in first_on_time or not on_time]
    hurried = [m for m in candidates if urgent(m)]

    def hard_start(m: ModelWork) -> float:
        """latest_start with its streams due by their gap cap: among the hurried, a first
        token at stake goes before a stream whose mean TPOT can absorb a gap."""
        r = m.running
        due = r.decode_gap_deadline if r.decode_gap_deadline is not None else r.decode_deadline
        hard = start_by(m, due)
        return hard if hard != float("inf") else latest_start(m)

    if hurried:
        pick = min(hurried, key=lambda m: (hard_start(m), latest_start(m), m.name))
    else:
        pick = min(
            candidates,
            key=lambda m: (
                prompt_start[m.name] is None,
                prompt_start[m.name] or 0.0,
                ready_since(m),
                m.name,
            ),
        )
    mine_on_time = [j for j in on_time if j.model == pick.name]
    mine_late = [j for j in late if j.model == pick.name]
    admit = mine_on_time + (mine_late if not on_time or not _others_wait(on_time, pick) else [])
    # another model's on-time prompts (waiting, or in their chunked prefill) must go on by
    # their latest start: the chunk ends before
    starts = [p for m in active if m is not pick and (p := prompt_start[m.name]) is not None]
    # the pick's own first token is at stake: other streams' chunk limit is their gap cap
    own = prompt_start[pick.name]
    ttft_at_stake = own is not None and own - now < min_step_s[pick.name] + overhead_s
    budget = _token_budget(
        pick, active, admit, now, overhead_s, min(starts, default=None), ttft_at_stake
    )
    return Pick(pick.name, tuple(j.key for j in admit), budget, tuple(j.key for j in late))


def _err(m: ModelWork) -> float:
    return max(m.latency.error or 0.0, SAFETY)


def _decode_due(m: ModelWork, now: float, overhead_s: float = 0.0) -> float | None:
    """When m's decodes must step: by the deadline of the stream due first; None if it is
    behind its mean (its deadline has passed) and cannot catch up, its decode step and the host
    time beside it being no shorter than the TPOT its mean banks per token. Such a stream has
    missed its SLO whatever runs next; holding to its deadline would put it before every
    other model's step for as long as it lasts, starving their requests. It is served like a
    late request instead: in its turn (the work that has waited longest first)."""
    r = m.running
    if (
        r.decode_deadline is not None
        and r.decode_deadline <= now
        and r.tpot_slo is not None
        and m.decode_s + overhead_s >= r.tpot_slo * (1 - TPOT_MARGIN)
    ):
        return None
    return r.decode_deadline


def _prefill_left(r: Request, lat: LatencyModel, chunk: int) -> tuple[float, int, int, float]:
    """A request in prefill as Running.prefills holds it."""
    todo, cached = r.num_tokens - r.num_computed_tokens, r.num_computed_tokens
    return (r.deadline, todo, cached, lat.chunked_prefill_s(todo, cached, chunk))


def _in_progress(active: Sequence[ModelWork]) -> list[Job]:
    """The prefills in progress as fixed jobs for Moore-Hodgson: each runs before its own
    model's waiting requests (its batch takes running requests first), so it is placed by the
    earlier of its deadline and theirs; a late one still takes its time."""
    out = []
    for m in active:
        first_wait = min((j.deadline for j in m.waiting), default=float("inf"))
        for i, (deadline, todo, cached, seconds) in enumerate(m.running.prefills):
            out.append(
                Job(
                    f"prefill/{m.name}/{i}",
                    m.name,
                    -1.0,
                    min(deadline, first_wait),
                    seconds,
                    tokens=todo,
                    cached=cached,
                )
            )
    return out


def _prompt_start_by(m: ModelWork, waiting: Sequence[Job], now: float) -> float | None:
    """When m must go on for each of its prompts to get its first token by its TTFT deadline:
    its prefills in progress first (its batch runs them before admitting), then its on-time
    waiting ones in deadline order, each after those before it (None: there is none, or each
    is late already: a late prefill is not a limit)."""
    work = [(d, seconds) for d, _, _, seconds in m.running.prefills]
    work += [(j.deadline, j.duration) for j in waiting]
    out, need = None, 0.0
    for deadline, seconds in work:
        need += seconds * (1 + _err(m))
        start_by = deadline - need
        if start_by > now and (out is None or start_by < out):
            out = start_by
    return out


def _others_wait(on_time: list[Job], pick: ModelWork) -> bool:
    return any(j.model != pick.name for j in on_time)


def _step_estimate(m: ModelWork, first: Job | None, chunk: int | None = None) -> float:
    """Its next step: its decodes, plus a chunk (at most `chunk` tokens, else its token limit)
    of the prefill in progress or else of its first on-time request."""
    shape = m.base
    cap = m.max_tokens if chunk is None else chunk
    if m.running.prefilling:
        shape = shape + StepShape.prefill(cap, m.running.prefill_cached)
    elif first is not None:
        shape = shape + StepShape.prefill(min(first.tokens, cap), first.cached)
    return m.latency.estimate(shape)


def _token_budget(
    m: ModelWork,
    active: list[ModelWork],
    admit: list[Job],
    now: float,
    overhead_s: float = 0.0,
    start_by: float | None = None,
    ttft_at_stake: bool = False,
) -> int:
    """The most tokens m's step may compute without making a running request of the device late,
    nor another model's on-time waiting request, which must start by `start_by` (never fewer
    than its decodes plus min_tokens, progress over perfection; but its decodes alone where that
    chunk would make them late)."""
    limit = own_limit = float("inf")
    if m.running.decode_deadline is not None:
        limit = own_limit = m.running.decode_deadline - now - overhead_s
    if start_by is not None:
        limit = min(limit, start_by - now - overhead_s)
    for o in active:  # their next step follows this one; its estimate may be short too
        due = o.running.decode_gap_deadline if ttft_at_stake else _decode_due(o, now, overhead_s)
        if o is not m and due is not None:
            after = o.decode_s * (1 + _err(o)) + 2 * overhead_s
            limit = min(limit, due - now - after)
    if limit == float("inf"):
        return m.max_tokens
    # the chunk continues the prefill in progress if there is one (it attends that context)
    cached = m.running.prefill_cached if m.running.prefilling else (admit[0].cached if admit else 0)
    limit /= 1 + _err(m)  # leave room for the estimate's own error
    if m.running.num and limit < m.latency.estimate(m.base):
        # its own decodes are late even if this step prefills nothing: small chunks would only
        # slow everything down (and make them later still); run a full step
        return m.max_tokens
    extra = m.latency.max_new_tokens(limit, m.base, cached, m.max_tokens)
    if (
        extra < m.min_tokens
        and m.running.num
        and own_limit / (1 + _err(m))
        < m.latency.estimate(m.base + StepShape.prefill(m.min_tokens, cached))
    ):
        # the smallest chunk worth a step would make its own decodes late: they step alone
        # (fast), and the slack they gain pays for a chunk later
        return m.running.num
    return max(
        min(m.running.num + extra, m.max_tokens), min(m.running.num + m.min_tokens, m.max_tokens)
    )
