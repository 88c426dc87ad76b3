"""One model on a device, driven by the device's engine thread only: its weights and KV (both in
pages of the device's pool), batch scheduler, model runner, sampler and output processor. It
publishes what it holds as a ModelSnapshot.

Residency (scheduler.snapshot.Residency): offloaded -> activating -> resident -> draining ->
offloaded. Activate = map the weight pages (one batched call) + start the chunked host-to-device
copy; the engine thread goes on stepping other models and the model serves once every byte has
landed. Evict = admit nothing new, let running requests finish for up to the drain time, requeue
the rest (they recompute after the next activation), give every KV page back, unmap the weights
(no copy: the host copy is the source of truth). The model object, its CUDA graphs and attention
state are kept: addresses never change. Each transition is all or nothing: a failed copy leaves
the model offloaded."""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvpool import HostCopy, KVLayout, PagedKV, PagePool, ShardedKV, Transfer, WeightBuffer
from models.attention.upload import tensor_on
from models.layers.causal_lm import weight_bytes
from prism_server.commands import TransitionRefused
from prism_server.model_runner import DeviceResources, ModelRunner, TensorParallelRunner
from prism_server.output_processor import OutputProcessor
from prism_server.profiler import profile_steps
from prism_server.sampler import Sampled, Sampler, logprob_list
from scheduler.arbitrator import ModelWork, model_work
from scheduler.batch_scheduler import BatchScheduler, ScheduledChunk, SchedulerConfig
from scheduler.latency_model import LatencyModel, StepShape
from scheduler.request import FinishReason, Request, RequestOutput, TokenLogprob
from scheduler.snapshot import ACTIVATION_BUCKETS, LatencySnapshot, ModelSnapshot, Residency

log = logging.getLogger(__name__)

SLO_LOG = 4096  # SLO outcomes kept
SLO_WINDOW_S = 60.0  # what `slo_recent` covers

TRANSITION_LOG = 64  # residency changes a snapshot carries
SLO_SCALE = 5.0  # an unset SLO: this many times the standalone estimate (the field's habit)


class ModelWorker:
    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        tokenizer,
        pool: PagePool,
        sched: SchedulerConfig,
        kv_dtype: torch.dtype,
        max_cached_pages: int = 1,
        weights: WeightBuffer | None = None,
        host: HostCopy | None = None,
        pinned: bool = False,
        keep_alive_s: float | None = None,
        resources: DeviceResources | None = None,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        profile_budget_s: float = 0.0,
        shard_pools: Sequence[PagePool] = (),
        shard_devices: Sequence[str] = (),
    ):
        """weights / host: the model's parameters live in `weights` (mapped now) and `host` holds
        their copy; without them the model cannot be evicted (tests, benchmarks). resources: what
        the device's models share (FlashInfer workspace, CUDA-graph pool). ttft/tpot_slo_s: its
        SLOs (None: SLO_SCALE x the latency model's standalone estimate of each request).
        profile_budget_s: how long the latency profile may take now (0: learn online only).
        shard_pools: a model split over several devices (model a TensorParallel, pool its first
        shard's device's, weights and host a ShardedWeights and a ShardedHostCopy): the other
        shards' pools, in order, and shard_devices their devices' names. Its KV is a ShardedKV,
        its steps eager."""
        self.name = name
        self.weights, self.host, self.pinned = weights, host, pinned
        self.keep_alive_s = keep_alive_s
        self.residency = Residency.RESIDENT
        self.state_since = self.last_used = time.monotonic()
        # the latest residency changes (time entered, state): the status view's timeline
        self.transitions: deque[tuple[float, Residency]] = deque(
            [(self.state_since, self.residency)], maxlen=TRANSITION_LOG
        )
        self.activations = self.evictions = self.bytes_activated = 0
        self.activation_seconds = 0.0
        self.activation_buckets = [0] * len(ACTIVATION_BUCKETS)
        self.last_activation_s: float | None = None
        self.last_eviction_s: float | None = None
        self.evicted_for: str | None = None  # why it was last evicted (None: resident since)
        self._transfer: Transfer | None = None  # the copy of an activation in flight
        self._activation_started = self._evict_started = self._drain_until = 0.0
        self._waiters: dict[Residency, list[Future]] = {}  # admin transitions waiting for a state
        cfg = model.config
        self.device = pool.backend.device
        layout = KVLayout(
            cfg.num_layers,
            sched.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype,
            pool.page_bytes,
            pool.backend.granularity,
        )
        # the pages it can address: the whole pool but its own weights (+ the null page)
        own = weights.num_pages if weights is not None else 0
        self.shard_devices = tuple(shard_devices)
        if shard_pools:
            pools = [pool, *shard_pools]
            owns = [w.num_pages for w in weights.parts] if weights is not None else [0] * len(pools)
            room = min(p.capacity + 1 - o for p, o in zip(pools, owns))
            self.kv = ShardedKV(
                pools, name, layout, room, max_cached_pages, sched.enable_prefix_caching
            )
        else:
            self.kv = PagedKV(
                pool,
                name,
                layout,
                pool.capacity + 1 - own,
                max_cached_pages,
                prefix_caching=sched.enable_prefix_caching,
            )
        self.scheduler = BatchScheduler(sched, self.kv.allocator, self.kv.allocator.prefix)
        allocated = _allocated(self.device)
        if shard_pools:
            self.runner = TensorParallelRunner(model, self.kv)
        else:
            self.runner = ModelRunner(model, self.kv.cache, self.device, resources=resources)
        if self.device.type == "cuda":
            self.runner.warm_up()  # every kernel compiled before the first request
        # device memory it holds outside the pool: attention state, graphs, buffers
        self.overhead_bytes = _allocated(self.device) - allocated
        self.sampler = Sampler(self.device)
        self.outputs = OutputProcessor(tokenizer, sched.max_model_len)
        self.requests: dict[str, Request] = {}
        self.weight_bytes = weight_bytes(model)
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.requests_total = 0
        self.slo = {k: [0, 0] for k in ("ttft", "tpot")}  # [met, missed] of finished requests
        # the outcomes of the last SLO_WINDOW_S (at most SLO_LOG), (time, kind, missed), and
        # their counts, kept as they come and go (a snapshot reads them, never scans the log)
        self.slo_log: deque[tuple[float, str, bool]] = deque()
        self._slo_recent = {k: [0, 0] for k in self.slo}
        self.num_deferred = 0  # waiting requests the arbitrator last deferred
        # sampled tokens whose text is not made yet (request, token, logprob, visible): made
        # while the device runs the next step (flush_outputs), in order
        self._unrendered: list[tuple[Request, int, TokenLogprob | None, bool]] = []
        # while a step of this model runs on the device (its text made meanwhile, or its tokens
        # not read yet), a request that ends keeps its KV blocks until no step in flight has it:
        # the step may still write them
        self._launching = False
        self._ended_in_step: list[Request] = []
        # launch ahead: a step whose tokens stay on the device until the next step of this
        # model is launched (or something needs them); its requests' next decode step is
        # launched first, from those tokens, so that the host's work hides behind the device's
        self.launch_ahead = resources is not None and resources.launch_ahead
        self.resources = resources  # its device's (None: resources of its own)
        self._ahead: _InFlight | None = None
        self.latency = LatencyModel()  # kept across evictions: a reactivation does not profile
        # the last step done: its shape, the latency model's estimate before it, and its seconds
        self.last_step: tuple[StepShape, float, float] | None = None
        # told of each step once done: (the worker, when it started (perf_counter), shape,
        # estimate, seconds); the device's step trace
        self.on_step: Callable[[ModelWorker, float, StepShape, float, float], None] | None = None
        if profile_budget_s > 0:
            t = time.perf_counter()
            profile = profile_steps(self.runner, self.scheduler, profile_budget_s)
            self.latency.fit_profile(profile)
            a = self.kv.allocator
            a.reclaim_pages(a.num_cached_pages)  # what the profile mapped goes back to the pool
            log.info(
                "profiled %s in %.2f s: %d shapes",
                name,
                time.perf_counter() - t,
                len(self.latency.profile),
            )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def resident(self) -> bool:
        return self.residency is Residency.RESIDENT

    @property
    def serving(self) -> bool:
        """Whether it runs batches (resident, or draining its running requests)."""
        return self.residency in (Residency.RESIDENT, Residency.DRAINING)

    @property
    def evictable(self) -> bool:
        return self.weights is not None and self.host is not None and not self.pinned

    def idle_until(self, keep_alive_s: float | None = None) -> float | None:
        """When its keep-alive (or the given one) runs out: it is then evicted although nothing
        needs its pages; None if that never happens now."""
        keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        if keep is None or not self.resident or not self.evictable or self.requests:
            return None
        return self.last_used + keep

    # ---- residency ------------------------------------------------------------------------------
    def when(self, state: Residency, done: Future) -> None:
        """Resolve `done` (with None) when the model is next in `state` (now if it is); a failed
        transition sets the error instead."""
        if self.residency is state:
            done.set_result(None)
        else:
            self._waiters.setdefault(state, []).append(done)

    def _enter(self, state: Residency) -> None:
        self.residency = state
        self.state_since = time.monotonic()
        self.transitions.append((self.state_since, state))
        for done in self._waiters.pop(state, ()):
            if not done.done():
                done.set_result(None)

    def _fail_waiters(self, error: BaseException, state: Residency | None = None) -> None:
        """Fail the transitions waiting for `state` (None: for any state) with `error`."""
        for waiting in list(self._waiters) if state is None else [state]:
            for done in self._waiters.pop(waiting, ()):
                if not done.done():
                    done.set_exception(error)

    def evict(self, drain_s: float = 0.0) -> None:
        """Start offloading: nothing new is admitted, running requests may finish for up to
        `drain_s` seconds, then the rest go back to the queue and every page goes back to the
        pool (at once if nothing runs or drain_s is 0; else in `poll`)."""
        if self.residency in (Residency.OFFLOADED, Residency.FAILED):
            return
        if not self.evictable:
            raise RuntimeError(f"model {self.name} cannot be evicted")
        if self.residency is Residency.ACTIVATING:
            self._land()  # the copy cannot be stopped half way: let it finish
        now = time.monotonic()
        if self.residency is Residency.RESIDENT:
            self._evict_started, self._drain_until = now, now + drain_s
            self.scheduler.admitting = False
            self._enter(Residency.DRAINING)
        else:  # draining already: the sooner deadline wins
            self._drain_until = min(self._drain_until, now + drain_s)
        self.poll()

    def poll(self) -> None:
        """Moves a transition on: activating -> resident once every byte has landed; draining ->
        offloaded once nothing runs or its drain time is up."""
        if self.residency is Residency.ACTIVATING and self._transfer.done():
            self._land()
        elif self.residency is Residency.DRAINING and (
            not self.scheduler.running or time.monotonic() >= self._drain_until
        ):
            self._offload()

    def _offload(self) -> None:
        self.flush_outputs()
        self.scheduler.preempt_all()
        self._settle_shards()
        self.kv.allocator.release_all()
        self.weights.unmap()
        self.scheduler.admitting = True
        self.evictions += 1
        self.last_eviction_s = time.monotonic() - self._evict_started
        self._enter(Residency.OFFLOADED)

    def can_activate(self) -> bool:
        return self.residency.on_device or self.weights.can_map()

    def activate(self, wait: bool = True) -> bool:
        """Map the weight pages and start the copy of the host copy into them; False (still
        offloaded, nothing taken) if the pool cannot give the pages now. A draining model goes
        back to resident. wait: return once every byte has landed (else `poll` finishes it)."""
        if self.residency is Residency.DRAINING:
            self.scheduler.admitting = True
            # an eviction waiting for this drain to end will not end: it is refused now
            self._fail_waiters(
                TransitionRefused(f"`{self.name}` was activated while draining"),
                Residency.OFFLOADED,
            )
            self._enter(Residency.RESIDENT)
        if self.residency is Residency.OFFLOADED:
            self._activation_started = time.perf_counter()
            if not self.weights.map():
                return False
            try:
                self._transfer = self.host.load_async(self.weights.bytes())
            except BaseException:
                self.weights.unmap()
                raise
            self._enter(Residency.ACTIVATING)
        if self.residency is Residency.ACTIVATING and wait:
            self._land()
        return self.residency.on_device

    def _land(self) -> None:
        """Finish the activation (waits for the last byte if need be)."""
        transfer, self._transfer = self._transfer, None
        try:
            transfer.wait()
        except BaseException as e:  # all or nothing: back to offloaded
            self.weights.unmap()
            self._enter(Residency.OFFLOADED)
            self._fail_waiters(e)
            raise
        took = time.perf_counter() - self._activation_started
        self.activations += 1
        self.activation_seconds += took
        self.last_activation_s = took
        self.activation_buckets[bisect.bisect_left(ACTIVATION_BUCKETS, took)] += 1
        self.bytes_activated += self.weights.nbytes
        self.last_used = time.monotonic()
        self.evicted_for = None
        self._enter(Residency.RESIDENT)
        log.info("activated %s in %.3f s", self.name, took)

    @property
    def max_kv_tokens(self) -> int:
        """The longest sequence whose KV this model could hold (every page it can address)."""
        return self.kv.allocator.capacity_blocks * self.scheduler.config.block_size

    # ---- commands -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        n = req.num_prompt_tokens
        req.priority = req.params.priority
        if req.ttft_slo is None:
            req.ttft_slo = self.ttft_slo_s or SLO_SCALE * self.latency.prefill_s(n)
        if req.tpot_slo is None:
            req.tpot_slo = self.tpot_slo_s or SLO_SCALE * self.latency.decode_s(1, n)
        self.requests[req.request_id] = req
        self.requests_total += 1
        self.scheduler.add(req)

    def work(self) -> ModelWork:
        """What the device's arbitrator needs of this model now."""
        return model_work(self.name, self.scheduler, self.latency)

    def abort(self, request_id: str) -> None:
        self.flush_outputs()
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, self.outputs.final(req, FinishReason.ABORT))

    def fail_all(self, error: str) -> None:
        """Finishes every request of this model with an error (the model's state is suspect)."""
        self.flush_outputs()
        for req in list(self.requests.values()):
            self._finish(req, self.outputs.final(req, FinishReason.ERROR, error))

    # ---- the step -------------------------------------------------------------------------------
    def step(
        self,
        now: float,
        admit: Sequence[str] | None = None,
        token_budget: int | None = None,
        while_running: Callable[[], None] | None = None,
    ) -> bool:
        """Runs one batch of this model; False if nothing could be scheduled. admit and
        token_budget: the arbitrator's pick (None: FCFS, the configured budget).

        while_running: host work for the time the device runs this step (a graph replay is
        launched and the host would only wait): the device's earlier tokens' text. Given it,
        this step's tokens that do not end their request by their ids leave their text (detok,
        stop strings, the delta to the client) to the next step's while_running, or to
        flush_outputs; without it, every token is rendered here.

        With launch_ahead, a step whose sampling needs nothing of the host leaves its tokens on
        the device; the next call launches its requests' next decode step from them (when the
        pick admits no one new and each has its blocks), then reads them while that step runs.
        A request that the unread token ended (EOS) runs one step for nothing, its token
        dropped. Anything else reads them first (`sync`)."""
        prev = self._ahead
        if prev is not None:
            follow = self._follow(prev, admit, token_budget)
            if follow is not None:
                self.last_used = now
                self._step_ahead(prev, follow, while_running)
                return True
            self.sync()
        batch = self.scheduler.schedule(now, admit, token_budget)
        if not batch:
            return False
        self.last_used = now
        try:
            t = time.perf_counter()
            scores: list = []
            self._launching = True
            logits = self.runner.execute(batch, scores, on_launch=while_running)
            for req, lps in scores:
                req.prompt_logprobs += lps
            sampling = [c.request for c in batch if c.samples]
            live = [i for i, r in enumerate(sampling) if r.finish_reason is None]
            if (
                self.launch_ahead
                and sampling
                and len(live) == len(sampling)
                and not any(self.sampler.needs_host(r) for r in sampling)
            ):
                sampled = self.sampler.launch(logits, sampling)
                self._ahead = _InFlight(batch, sampling, sampled, t, while_running is not None)
                self._launching = False
                return True
            if len(live) < len(sampling):  # ended by a stop string while this step ran
                logits = logits[tensor_on(live, torch.long, logits.device)]
            got, got_lp = self.sampler.sample(logits, [sampling[i] for i in live])
            tokens, logprobs = [-1] * len(sampling), [None] * len(sampling)  # -1: not sampled
            for i, tok, lp in zip(live, got, got_lp):
                tokens[i], logprobs[i] = tok, lp
            if not got and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # nothing sampled: no sync
            took = time.perf_counter() - t  # sampling synchronizes: the step has run
            self._launching = False
            self._release_ended()
            self._done(batch, t, took)
        except Exception as e:  # a failed step fails its requests, not the engine
            self._fail_step(batch, e)
            return True
        self.scheduler.advance(batch)
        self._publish(sampling, tokens, logprobs, defer=while_running is not None)
        return True

    def _follow(
        self, prev: _InFlight, admit: Sequence[str] | None, token_budget: int | None
    ) -> list[tuple[ScheduledChunk, int]] | None:
        """The decode step that can be launched before prev's tokens are read, as (chunk, row of
        prev's tokens that is its input); None if the pick admits new work, a running request
        is not one of prev's sampling rows (a prefill chunk), the budget is short, a request's
        next token needs the host, or blocks are short (the usual step then preempts)."""
        s = self.scheduler
        if admit or (admit is None and s.waiting and s.admitting):
            return None
        rows = {id(r): i for i, r in enumerate(prev.rows) if r.finish_reason is None}
        running = [r for r in s.running if r.finish_reason is None]
        if any(id(r) not in rows for r in running):
            return None
        limit = s.config.max_model_len
        # prev's token ends a request by its length: no step after it
        go = [
            r
            for r in running
            if r.num_output_tokens + 1 < r.params.max_tokens and r.num_tokens + 1 < limit
        ]
        if not go or (token_budget is not None and len(go) > token_budget):
            return None
        if any(self.sampler.needs_host(r) for r in go):
            return None
        go.sort(key=lambda r: rows[id(r)])
        for r in go:  # position num_tokens: prev's token, the input of this step
            if not s.grow(r, r.num_tokens + 1):
                return None  # blocks taken for the others stay theirs: their next steps use them
        return [(ScheduledChunk(r, r.num_tokens, 1), rows[id(r)]) for r in go]

    def _step_ahead(
        self,
        prev: _InFlight,
        follow: list[tuple[ScheduledChunk, int]],
        while_running: Callable[[], None] | None,
    ) -> None:
        """Launch the decode step that follows prev from prev's tokens on the device, then read
        prev's tokens (the device runs this step meanwhile) and publish them."""
        batch = [c for c, _ in follow]
        cur = None
        try:
            t = time.perf_counter()
            self._launching = True
            for c in batch:
                c.request.reserve_token()
            rows = [i for _, i in follow]
            ids = prev.sampled.tokens
            if rows != list(range(len(prev.rows))):
                ids = ids[tensor_on(rows, torch.long, ids.device)]
            logits = self.runner.execute(batch, input_ids=ids)
            reqs = [c.request for c in batch]
            sampled = self.sampler.launch(logits, reqs, unread=ids)  # prev's tokens, unread
            cur = _InFlight(batch, reqs, sampled, t, prev.defer)
            self._ahead = cur
            self._launching = False
            self._collect(prev, cur)
        except Exception as e:
            self._ahead = None
            self._launching = False
            self._fail_step(prev.batch + (cur.batch if cur is not None else batch), e)
            return
        if while_running is not None:
            while_running()

    def sync(self) -> None:
        """Read the tokens of the step launched ahead, if any, and publish them (waits for the
        device); then no step of this model is in flight."""
        f, self._ahead = self._ahead, None
        if f is None:
            return
        try:
            self._collect(f, None)
        except Exception as e:
            self._fail_step(f.batch, e)

    def _collect(self, f: _InFlight, nxt: _InFlight | None) -> None:
        """f's tokens, once the device has them; nxt: the step launched after f, in flight (it
        starts on the device as f ends)."""
        tokens, lps = f.read()
        done = time.perf_counter()
        if nxt is not None:
            nxt.start = max(nxt.start, done)
        self._release_ended()
        self._done(f.batch, f.start, done - f.start)
        self.scheduler.advance(f.batch)
        self._publish(f.rows, tokens, logprob_list(tokens, f.rows, lps), defer=f.defer)

    def _done(self, batch: list[ScheduledChunk], start: float, took: float) -> None:
        """A step has run, from start for took seconds: the latency model learns it."""
        shape = StepShape.of((c.start, c.num_new) for c in batch)
        self.last_step = (shape, self.latency.observe(shape, took), took)
        if self.on_step is not None:
            self.on_step(self, start, shape, self.last_step[1], took)

    def _fail_step(self, batch: list[ScheduledChunk], e: Exception) -> None:
        """A failed step fails its requests (the model's state is suspect), not the engine."""
        log.exception("step of model %s failed", self.name, exc_info=e)
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):  # what it launched is done (or failed)
                torch.cuda.synchronize(self.device)
        self._launching = False
        self._release_ended()
        self.flush_outputs(collect=False)
        error = f"{type(e).__name__}: {e}"
        for c in batch:
            req = c.request
            if req.finish_reason is None and not req.is_finished:  # not ended meanwhile
                self._finish(req, self.outputs.final(req, FinishReason.ERROR, error))

    def _publish(self, rows: list[Request], tokens, logprobs, defer: bool) -> None:
        """Each sampling row's token (-1: not sampled) and logprob to its request."""
        now = time.monotonic()
        for req, tok, lp in zip(rows, tokens, logprobs):
            if req.finish_reason is not None:  # a stop string in its text, made as this step ran
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                if req.ttft_slo is not None:
                    self._slo("ttft", now - req.arrival_time > req.ttft_slo, now)
            req.last_token_time = now
            complete = req.request_id in self.sampler.completed
            reason, visible = self.outputs.accept(req, tok, complete)
            if defer and reason is None:
                self._unrendered.append((req, tok, lp, visible))
                continue
            self.flush_outputs(collect=False)  # its earlier tokens' text first
            self._render(req, tok, lp, reason, visible)

    def flush_outputs(self, collect: bool = True) -> None:
        """Makes the text of the tokens sampled but not yet rendered, in order, and sends it;
        a stop string in it ends its request. collect: the tokens of a step launched ahead
        first (waits for it)."""
        if collect:
            self.sync()
        todo, self._unrendered = self._unrendered, []
        for req, tok, lp, visible in todo:
            if req.finish_reason is None:
                self._render(req, tok, lp, None, visible)

    def _render(self, req: Request, tok: int, lp, reason, visible: bool) -> None:
        out = self.outputs.render(req, tok, lp, reason, visible)
        if out.finished:
            self._finish(req, out)
        else:
            self._emit(req, out)

    def _slo(self, kind: str, missed: bool, now: float) -> None:
        self.slo[kind][missed] += 1
        self.slo_log.append((now, kind, missed))
        self._slo_recent[kind][missed] += 1
        if len(self.slo_log) > SLO_LOG:
            self._forget_slo()

    def _finish(self, req: Request, out: RequestOutput) -> None:
        n = req.num_output_tokens
        if n > 1 and req.tpot_slo is not None and req.first_token_time is not None:
            tpot = (req.last_token_time - req.first_token_time) / (n - 1)
            self._slo("tpot", tpot > req.tpot_slo, req.last_token_time)
        if self._on_device:  # its blocks may be written by a step in flight: free them after
            self._ended_in_step.append(req)
        else:
            self.scheduler.finish(req)
            self.sampler.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self._emit(req, out)

    @property
    def _on_device(self) -> bool:
        """Whether a step of this model is in flight (launching, or its tokens not read)."""
        return self._launching or self._ahead is not None

    def _release_ended(self) -> None:
        """A step is done: the requests that ended while it ran give back their blocks, but
        for those in the step still in flight (launched ahead)."""
        busy = {id(r) for r in self._ahead.rows} if self._ahead is not None else set()
        ended, self._ended_in_step = self._ended_in_step, []
        for req in ended:
            if id(req) in busy:
                self._ended_in_step.append(req)
            else:
                self.scheduler.finish(req)
                self.sampler.forget(req.request_id)

    def _emit(self, req: Request, out: RequestOutput) -> None:
        if req.sink is None:
            return
        try:
            req.sink(out)
        except Exception:
            log.exception("output sink of request %s failed", req.request_id)

    # ---- what it publishes ----------------------------------------------------------------------
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

    def check_integrity(self) -> None:
        self.sync()
        self.kv.check_integrity()
        if self.weights is not None:
            self.weights.check_integrity()
            assert self.weights.mapped == self.residency.on_device, (self.name, self.residency)
        if not self.serving:
            assert self.kv.allocator.num_mapped_pages == 0, "an offloaded model holds KV pages"

    def leave_device(self) -> HostCopy:
        """An offloaded model with no request gives back everything it holds on its device (its
        KV range, its weight range) and hands over its host copy: it moves to another device.
        This worker is done with."""
        assert self.residency is Residency.OFFLOADED and not self.requests, self.residency
        self._fail_waiters(RuntimeError(f"model {self.name} moved to another device"))
        self.kv.close()
        self.weights.close()
        host, self.host = self.host, None
        return host

    def inherit(self, old: ModelWorker) -> None:
        """Take over the history of the worker this model had on another device: its latency
        model, counters, SLO outcomes and residency timeline (what the status and the
        control loop read)."""
        self.latency = old.latency
        for name in (
            "activations",
            "evictions",
            "bytes_activated",
            "activation_seconds",
            "activation_buckets",
            "last_activation_s",
            "last_eviction_s",
            "requests_total",
            "slo",
            "slo_log",
            "_slo_recent",
        ):
            setattr(self, name, getattr(old, name))
        self.transitions = deque([*old.transitions, *self.transitions], maxlen=TRANSITION_LOG)

    def _settle_shards(self) -> None:
        """A split model's kernels on its other devices done, before its pages there go: its
        last step there (the final norm, after the last all-reduce) reads its weights there,
        and reading its tokens waits for its first device only."""
        if isinstance(self.runner, TensorParallelRunner):
            for d in self.runner.model.devices[1:]:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)

    def close(self) -> None:
        self.sync()  # nothing of it on the device when its pages go
        self._settle_shards()
        if self._transfer is not None:  # never free pages a copy is still writing
            self._transfer.wait()
            self._transfer = None
        self._fail_waiters(RuntimeError(f"model {self.name} was removed"))
        for rid in list(self.requests):
            self.abort(rid)
        self.kv.close()
        if self.weights is not None:
            self.weights.close()
        if self.host is not None:
            self.host.close()


@dataclass
class _InFlight:
    """A step launched whose tokens are not read yet."""

    batch: list[ScheduledChunk]
    rows: list[Request]  # the requests of the sampled rows
    sampled: Sampled  # the tokens (and logprobs) on the device
    start: float  # perf_counter when the device could start it
    defer: bool  # its tokens' text waits for the next step's launch
    host: list[torch.Tensor] | None = None  # their copies in pinned host memory (CUDA)
    copied: torch.cuda.Event | None = None

    def __post_init__(self):
        if self.sampled.tokens.is_cuda:  # the copy back starts now, behind the step
            self.host = []
            for t in self.sampled.tensors():
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                self.host.append(h)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> tuple[list[int], list[list] | None]:
        """The tokens, and the logprob lists (rows, chosen, top values, top ids) or None."""
        if self.copied is None:
            got = [t.tolist() for t in self.sampled.tensors()]
        else:
            self.copied.synchronize()
            got = [h.tolist() for h in self.host]
        return got[0], got[1:] or None


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
