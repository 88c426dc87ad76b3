"""One model on a device, driven by the device's engine thread only: its weights and KV (both in
pages of the device's pool), batch scheduler, model runner, sampler and output processor. It
publishes what it holds as a ModelSnapshot.

Residency: resident (weights mapped, serving) or offloaded (weights only in the host copy). Evict
= preempt running requests back to the queue, give every KV page back, unmap the weights (no copy:
the host copy is the source of truth). Activate = map the weight pages + one chunked host-to-device
copy. The model object, its CUDA graphs and attention state are kept: addresses never change."""

from __future__ import annotations

import logging
import time

import torch

from kvpool import HostCopy, KVLayout, PagedKV, PagePool, WeightBuffer
from models.layers.causal_lm import weight_bytes
from prism_server.model_runner import ModelRunner
from prism_server.output_processor import OutputProcessor
from prism_server.sampler import Sampler
from scheduler.batch_scheduler import BatchScheduler, ScheduledChunk, SchedulerConfig
from scheduler.request import FinishReason, Request, RequestOutput
from scheduler.snapshot import ModelSnapshot, Residency

log = logging.getLogger(__name__)


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
    ):
        """weights / host: the model's parameters live in `weights` (mapped now) and `host` holds
        their copy; without them the model cannot be evicted (tests, benchmarks)."""
        self.name = name
        self.weights, self.host, self.pinned = weights, host, pinned
        self.keep_alive_s = keep_alive_s
        self.residency = Residency.RESIDENT
        self.activations = self.evictions = self.bytes_activated = 0
        self.activation_seconds = 0.0
        self.last_activation_s: float | None = None
        self.last_used = time.monotonic()
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
        self.kv = PagedKV(pool, name, layout, pool.capacity + 1 - own, max_cached_pages)
        self.scheduler = BatchScheduler(sched, self.kv.allocator)
        self.runner = ModelRunner(model, self.kv.cache, self.device)
        self.sampler = Sampler(self.device)
        self.outputs = OutputProcessor(tokenizer, sched.max_model_len)
        self.requests: dict[str, Request] = {}
        self.weight_bytes = weight_bytes(model)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def resident(self) -> bool:
        return self.residency is Residency.RESIDENT

    @property
    def evictable(self) -> bool:
        return self.weights is not None and self.host is not None and not self.pinned

    def idle_until(self) -> float | None:
        """When its keep-alive runs out (it is then evicted although nothing needs its pages);
        None if that never happens now."""
        if self.keep_alive_s is None or not self.resident or not self.evictable or self.requests:
            return None
        return self.last_used + self.keep_alive_s

    # ---- residency ------------------------------------------------------------------------------
    def evict(self) -> None:
        """Offload: running requests go back to the queue (they recompute after the next
        activation), every KV page goes back to the pool, the weight pages are unmapped."""
        if not self.resident:
            return
        if not self.evictable:
            raise RuntimeError(f"model {self.name} cannot be evicted")
        self.scheduler.preempt_all()
        self.kv.allocator.release_all()
        self.weights.unmap()
        self.residency = Residency.OFFLOADED
        self.evictions += 1

    def can_activate(self) -> bool:
        return self.resident or self.weights.can_map()

    def activate(self, now: float) -> bool:
        """Map the weight pages and copy the host copy in; False (still offloaded, nothing
        taken) if the pool cannot give the pages now."""
        if self.resident:
            return True
        t = time.perf_counter()
        if not self.weights.map():
            return False
        try:
            self.host.load(self.weights.bytes())
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # timed to the last byte
        except BaseException:
            self.weights.unmap()  # all or nothing: back to offloaded
            raise
        took = time.perf_counter() - t
        self.residency = Residency.RESIDENT
        self.activations += 1
        self.activation_seconds += took
        self.last_activation_s = took
        self.bytes_activated += self.weights.nbytes
        self.last_used = now
        return True

    @property
    def max_kv_tokens(self) -> int:
        """The longest sequence whose KV this model could hold (every page it can address)."""
        return self.kv.allocator.capacity_blocks * self.scheduler.config.block_size

    # ---- commands -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, self.outputs.final(req, FinishReason.ABORT))

    def fail_all(self, error: str) -> None:
        """Finishes every request of this model with an error (the model's state is suspect)."""
        for req in list(self.requests.values()):
            self._finish(req, self.outputs.final(req, FinishReason.ERROR, error))

    # ---- the step -------------------------------------------------------------------------------
    def step(self, now: float) -> bool:
        """Runs one batch of this model; False if nothing could be scheduled."""
        batch = self.scheduler.schedule(now)
        if not batch:
            return False
        self.last_used = now
        try:
            logits = self.runner.execute(batch)
            tokens, logprobs = self.sampler.sample(logits, [c.request for c in batch if c.samples])
        except Exception as e:  # a failed step fails its requests, not the engine
            log.exception("step of model %s failed", self.name)
            error = f"{type(e).__name__}: {e}"
            for c in batch:
                self._finish(c.request, self.outputs.final(c.request, FinishReason.ERROR, error))
            return True
        self.scheduler.advance(batch)
        self._publish(batch, tokens, logprobs)
        return True

    def _publish(self, batch: list[ScheduledChunk], tokens, logprobs) -> None:
        it = iter(zip(tokens, logprobs))
        for c in batch:
            if not c.samples:
                continue
            tok, lp = next(it)
            out = self.outputs.process(c.request, tok, lp)
            if out.finished:
                self._finish(c.request, out)
            else:
                self._emit(c.request, out)

    def _finish(self, req: Request, out: RequestOutput) -> None:
        self.scheduler.finish(req)
        self.sampler.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self._emit(req, out)

    def _emit(self, req: Request, out: RequestOutput) -> None:
        if req.sink is None:
            return
        try:
            req.sink(out)
        except Exception:
            log.exception("output sink of request %s failed", req.request_id)

    # ---- what it publishes ----------------------------------------------------------------------
    def snapshot(self) -> ModelSnapshot:
        a, s = self.kv.allocator, self.scheduler
        lay = self.kv.layout
        cached = a.num_cached_pages
        return ModelSnapshot(
            name=self.name,
            residency=self.residency,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
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
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.weights is not None:
            self.weights.check_integrity()
            assert self.weights.mapped == self.resident, (self.name, self.residency)
        if not self.resident:
            assert self.kv.allocator.num_mapped_pages == 0, "an offloaded model holds KV pages"

    def close(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.kv.close()
        if self.weights is not None:
            self.weights.close()
        if self.host is not None:
            self.host.close()
