"""One model resident on a device: its KV cache (pages from the device's pool), batch scheduler,
model runner, sampler and output processor. Driven by the device's engine thread only."""

from __future__ import annotations

import logging

import torch

from kvpool import KVCache, KVLayout, PagePool
from prism_server.model_runner import ModelRunner
from prism_server.output_processor import OutputProcessor
from prism_server.request import FinishReason, Request, RequestOutput
from prism_server.sampler import Sampler
from scheduler.batch_scheduler import BatchScheduler, ScheduledChunk, SchedulerConfig

log = logging.getLogger(__name__)


class ContextLengthExceeded(ValueError):
    """The prompt plus the requested tokens exceed what the model can hold."""


class ModelEngine:
    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        tokenizer,
        model_config,
        pool: PagePool,
        sched: SchedulerConfig,
        kv_dtype: torch.dtype,
        max_cached_pages: int = 1,
    ):
        self.name = name
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.device = pool.backend.device
        layout = KVLayout(
            model_config.num_layers,
            sched.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            kv_dtype,
            pool.page_bytes,
            pool.backend.granularity,
        )
        self.kv_cache = KVCache(
            pool, name, layout, max_pages=pool.capacity + 1, max_cached_pages=max_cached_pages
        )
        self.scheduler = BatchScheduler(sched, self.kv_cache.allocator)
        self.runner = ModelRunner(model, self.kv_cache, self.device)
        self.sampler = Sampler(self.device)
        self.outputs = OutputProcessor(tokenizer, sched.max_model_len)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError if a request of this size can never run on this model."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {num_prompt_tokens} prompt tokens and asks for {max_tokens} more."
            )
        if self.scheduler.blocks_needed(total) > self.kv_cache.allocator.capacity_blocks:
            raise ContextLengthExceeded(
                f"{total} tokens do not fit in the KV cache this model can address"
            )

    # ---- engine-thread side -------------------------------------------------------------------
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

    def step(self) -> bool:
        """Runs one batch of this model; False if nothing could be scheduled."""
        batch = self.scheduler.schedule()
        if not batch:
            return False
        try:
            logits = self.runner.execute(batch)
            sampling = [c.request for c in batch if c.samples]
            tokens, logprobs = self.sampler.sample(logits, sampling)
        except Exception as e:  # a failed step fails its requests, not the engine
            log.exception("step of model %s failed", self.name)
            error = f"{type(e).__name__}: {e}"
            for c in batch:
                self._finish(c.request, self.outputs.final(c.request, FinishReason.ERROR, error))
            return True
        self._publish(batch, tokens, logprobs)
        return True

    def _publish(self, batch: list[ScheduledChunk], tokens, logprobs) -> None:
        it = iter(zip(tokens, logprobs))
        for c in batch:
            req = c.request
            samples = c.samples
            req.num_computed_tokens += c.num_new
            if not samples:
                continue
            tok, lp = next(it)
            out = self.outputs.process(req, tok, lp)
            if out.finished:
                self._finish(req, out)
            else:
                self._emit(req, out)

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

    def close(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)
        self.kv_cache.close()
