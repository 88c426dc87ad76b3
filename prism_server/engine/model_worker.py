"""One model on a device, driven by the device's engine thread only: its weights and KV (both in
pages of the device's pool), batch scheduler, model runner, sampler and output processor.

This file holds the step: schedule -> run -> sample -> postprocess (the text of the tokens, stop
strings, the output to the client), and launch ahead: a step whose tokens stay on the device
while the next decode step is launched from them. The residency state machine is in
residency.py, the SLO accounting and the ModelSnapshot in model_stats.py, what its step does with
its LoRA adapters in model_adapters.py; worker_build.py makes a worker in named steps (its KV, its
runner with its CUDA graphs, its latency profile)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool import HostCopy, PagedKV, ShardedKV, WeightBuffer
from models.attention.upload import tensor_on
from models.layers.causal_lm import weight_bytes
from prism_server.engine.model_adapters import ModelAdapters
from prism_server.engine.model_runner import DeviceResources, ModelRunner, TensorParallelRunner
from prism_server.engine.model_stats import ModelStats
from prism_server.engine.output_processor import OutputProcessor
from prism_server.engine.residency import BLOCKED_POLL_S, TRANSFER_POLL_S, ModelResidency
from prism_server.engine.sampler import Sampled, Sampler, logprob_list
from scheduler.arbitrator import ModelWork, model_work
from scheduler.batch_scheduler import BatchScheduler, ScheduledChunk, SchedulerConfig
from scheduler.latency_model import StepShape
from scheduler.request import FinishReason, Request, RequestOutput, TokenLogprob
from scheduler.snapshot import Residency

log = logging.getLogger(__name__)


class ModelWorker(ModelAdapters, ModelResidency, ModelStats):
    """One model on a device: its requests, its step and launch ahead. Its LoRA adapters, its
    residency and its accounting come from its three bases."""

    def __init__(
        self,
        name: str,
        kv: PagedKV | ShardedKV,
        runner: ModelRunner,
        tokenizer,
        sched: SchedulerConfig,
        device: torch.device,
        *,
        weights: WeightBuffer | None = None,
        host: HostCopy | None = None,
        pinned: bool = False,
        keep_alive_s: float | None = None,
        resources: DeviceResources | None = None,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        overhead_bytes: int = 0,
        shard_devices: Sequence[str] = (),
    ):
        """A worker over a built KV and runner (worker_build.assemble_worker makes both).
        overhead_bytes: the device memory the runner holds outside the pool (attention state,
        graphs, buffers)."""
        ModelAdapters.__init__(self)
        ModelResidency.__init__(self, weights, host, pinned, keep_alive_s)
        ModelStats.__init__(self, ttft_slo_s, tpot_slo_s)
        self.name, self.device, self.shard_devices = name, device, tuple(shard_devices)
        self.kv, self.runner, self.overhead_bytes = kv, runner, overhead_bytes
        self.scheduler = BatchScheduler(sched, kv.allocator, kv.allocator.prefix)
        self.sampler = Sampler(device)
        self.outputs = OutputProcessor(tokenizer, sched.max_model_len)
        self.requests: dict[str, Request] = {}
        self.weight_bytes = weight_bytes(runner.model)
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
        # the last step done: its shape, the latency model's estimate before it, and its seconds
        self.last_step: tuple[StepShape, float, float] | None = None
        # told of each step once done: (the worker, when it started (perf_counter), shape,
        # estimate, seconds); the device's step trace
        self.on_step: Callable[[ModelWorker, float, StepShape, float, float], None] | None = None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def poll_after(self) -> float | None:
        """How soon the device's loop must look at this model again when no step ran (None: at
        its next command): a copy in flight (its activation's, an adapter's) soon; work that
        cannot be scheduled yet, or a drain, a little later."""
        if self.residency is Residency.ACTIVATING or self.adapters_loading:
            return TRANSFER_POLL_S
        if self.has_work or self.residency is Residency.DRAINING:
            return BLOCKED_POLL_S
        return None

    @property
    def max_kv_tokens(self) -> int:
        """The longest sequence whose KV this model could hold (every page it can address)."""
        return self.kv.allocator.capacity_blocks * self.scheduler.config.block_size

    # ---- commands -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.adapter is not None and not self._accept_adapter(req):
            return
        req.priority = req.params.priority
        self.set_slos(req)
        self.requests[req.request_id] = req
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
        admit = self._admit_adapters(admit, now)
        batch = self.scheduler.schedule(now, admit, token_budget)
        if self.adapters and self.adapters.short_of_pages:
            self.scheduler.blocked = True  # an adapter's requests wait for its pages
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
                self.ttft_outcome(req, now)
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

    def _finish(self, req: Request, out: RequestOutput) -> None:
        self.tpot_outcome(req)
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

    # ---- the worker's end -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.sync()
        self.kv.check_integrity()
        if self.weights is not None:
            self.weights.check_integrity()
            assert self.weights.mapped == self.residency.on_device, (self.name, self.residency)
        if not self.serving:
            assert self.kv.allocator.num_mapped_pages == 0, "an offloaded model holds KV pages"
        if self.adapters is not None:
            self.adapters.check_integrity(self.residency.on_device)

    def inherit(self, old: ModelWorker) -> None:
        """Take over the history of the worker this model had on another device: its latency
        model, counters, SLO outcomes and residency timeline (what the status and the
        control loop read)."""
        self.inherit_stats(old)
        self.inherit_residency(old)

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
        self.close_residency()
        for rid in list(self.requests):
            self.abort(rid)
        if self.adapters is not None:
            self.adapters.close()
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
