"""The asyncio side of the engine: submits requests to the engine thread, streams their outputs
back through a thread-safe handoff, enforces queue limits, aborts on cancellation (client gone),
and records request metrics. The event loop never waits on model work."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from prism_server.engine import Engine
from prism_server.protocol import APIError
from prism_server.request import RequestOutput
from prism_server.sampling_params import SamplingParams
from prism_server.server.metrics import Metrics

RETRY_AFTER_S = 1


def overloaded(message: str) -> APIError:
    return APIError(
        503,
        message,
        "server_error",
        code="server_is_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int):
        self.engine = engine
        self.metrics = Metrics(engine)
        self.max_queued = max_queued_requests
        self._queued: dict[str, int] = defaultdict(int)  # accepted, no output yet, per model
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def _admit(self, model: str) -> None:
        if self.draining:
            raise APIError(
                503, "The server is shutting down.", "server_error", code="server_shutting_down"
            )
        spec = self.engine.config.models_by_name.get(model)
        limit = spec.max_queued_requests if spec else self.max_queued
        if self._queued[model] >= limit or sum(self._queued.values()) >= self.max_queued:
            self.metrics.rejected.labels(model, "queue_full").inc()
            raise overloaded(f"Too many requests are queued for `{model}`; retry later.")

    def submit(
        self, model: str, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queues a request; raises ModelNotFound, ValueError (cannot run) or APIError (503)
        before anything is accepted. Iterate the stream for its deltas; close it to abort."""
        self._admit(model)
        stream = RequestStream(self, model)
        stream.request = self.engine.add_request(model, prompt_ids, params, stream.sink, request_id)
        self._queued[model] += 1
        self.metrics.pending.labels(model).inc()
        self.in_flight += 1
        self._idle.clear()
        return stream

    def _release(self, stream: RequestStream) -> None:
        if stream.queued:
            self._queued[stream.model] -= 1
            self.metrics.pending.labels(stream.model).dec()
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _on_start(self, model: str, out: RequestOutput, arrival: float, now: float) -> None:
        m = self.metrics
        m.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
        if out.first_scheduled_time is not None:
            m.queue_time.labels(model).observe(max(out.first_scheduled_time - arrival, 0.0))
        if out.new_token_ids:
            ttft = now - arrival
            m.ttft.labels(model).observe(ttft)
            spec = self.engine.config.models_by_name.get(model)
            if spec and spec.ttft_slo_ms:
                met = ttft * 1000 <= spec.ttft_slo_ms
                m.slo.labels(model, "ttft", "met" if met else "missed").inc()

    def _on_finish(
        self, model: str, out: RequestOutput, arrival: float, first: float | None, now: float
    ) -> None:
        m = self.metrics
        m.e2e.labels(model).observe(now - arrival)
        m.request_success.labels(model, out.finish_reason.value).inc()
        spec = self.engine.config.models_by_name.get(model)
        if spec and spec.tpot_slo_ms and first is not None and out.num_output_tokens > 1:
            tpot = (now - first) / (out.num_output_tokens - 1)
            met = tpot * 1000 <= spec.tpot_slo_ms
            m.slo.labels(model, "tpot", "met" if met else "missed").inc()

    async def drain(self, timeout: float) -> bool:
        """Stops accepting requests and waits for those in flight; False on timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class RequestStream:
    """The output deltas of one submitted request, consumed on the event loop."""

    def __init__(self, owner: AsyncEngine, model: str):
        self.owner, self.model = owner, model
        self.request = None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.queued = True  # no output yet
        self.finished = False
        self.closed = False

    def sink(self, out: RequestOutput) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        out = await self.queue.get()
        now = time.monotonic()
        owner = self.owner
        if self.queued:
            self.queued = False
            owner._queued[self.model] -= 1
            owner.metrics.pending.labels(self.model).dec()
            owner._on_start(self.model, out, self.arrival, now)
        if out.new_token_ids:
            if self.last_token is not None:
                owner.metrics.itl.labels(self.model).observe(now - self.last_token)
            self.first_token = self.first_token or now
            self.last_token = now
            owner.metrics.generation_tokens.labels(self.model).inc(len(out.new_token_ids))
        if out.finished:
            self.finished = True
            owner._on_finish(self.model, out, self.arrival, self.first_token, now)
            self.aclose_sync()
        return out

    def aclose_sync(self) -> None:
        """Releases the request; aborts it in the engine if it has not finished."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.owner.engine.abort(self.model, self.request.request_id)
            self.owner.metrics.request_success.labels(self.model, "abort").inc()
        self.owner._release(self)

    async def aclose(self) -> None:
        self.aclose_sync()
