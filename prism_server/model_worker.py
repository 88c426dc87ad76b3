"""One model on a device, driven by the device's engine thread only: its KV (storage and block
placement, pages from the device's pool), batch scheduler, model runner, sampler and output
processor. It publishes what it holds as a ModelSnapshot."""

from __future__ import annotations

import logging

import torch

from kvpool import KVLayout, PagedKV, PagePool
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
    ):
        self.name = name
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
        self.kv = PagedKV(pool, name, layout, pool.capacity + 1, max_cached_pages)
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
            residency=Residency.RESIDENT,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            kv_pages_in_use=a.num_mapped_pages - cached,
            kv_pages_cached_free=cached,
            kv_blocks_used=a.num_used_blocks,
            kv_blocks_capacity=a.capacity_blocks,
            kv_block_bytes=lay.block_bytes * lay.num_layers,
            weight_pages=0,  # weights are outside the pool (for now)
            weight_bytes=self.weight_bytes,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def close(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.kv.close()
