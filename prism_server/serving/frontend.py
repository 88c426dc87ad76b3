"""The frontend: the event loop's side of the engine. It admits requests (queue bounds, draining),
hands them to the engine, streams their outputs back through a thread-safe handoff, aborts those
whose client went away, and records request metrics and the request log. The event loop never
waits on model work."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

from prism_server.engine.engine import Engine
from prism_server.served_model import ServedModel
from prism_server.serving.metrics import Metrics
from prism_server.serving.protocol import APIError
from prism_server.serving.request_log import RequestLog, record
from scheduler.request import RequestOutput
from scheduler.sampling_params import SamplingParams

RETRY_AFTER_S = 1


def overloaded(message: str) -> APIError:
    return APIError(
        503,
        message,
        "server_error",
        code="server_is_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class Frontend:
    def __init__(self, engine: Engine, max_queued_requests: int, request_log: str | None = None):
        """request_log: the file that gets a JSON line per request that ends (None: none)."""
        self.engine = engine
        self.metrics = Metrics(engine.snapshots, engine.plan_view, engine.config.max_loras)
        self.max_queued = max_queued_requests
        self.request_log = RequestLog(request_log) if request_log is not None else None
        self._queued: dict[str, int] = defaultdict(int)  # accepted, no output yet, per model
        self._open: set[RequestStream] = set()  # accepted, not yet released
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def check_batch(self, served: ServedModel, n: int) -> None:
        """A request of n completions that could never be queued at once: 400 naming the bound
        (503 would tell the client to retry what can never succeed)."""
        bound, what = min(
            (served.spec.max_queued_requests, f"max_queued_requests of `{served.name}`"),
            (self.max_queued, "the server's max_queued_requests"),
        )
        if n > bound:
            raise APIError(
                400,
                f"This request asks for {n} completions (prompts x n); at most {bound} can be "
                f"queued ({what}).",
                param="n",
                code="too_many_completions",
            )

    def _admit(self, served: ServedModel) -> None:
        if self.draining:
            raise APIError(
                503, "The server is shutting down.", "server_error", code="server_shutting_down"
            )
        name = served.name
        if (
            self._queued[name] >= served.spec.max_queued_requests
            or sum(self._queued.values()) >= self.max_queued
        ):
            self.metrics.rejected.labels(name, "queue_full").inc()
            raise overloaded(f"Too many requests are queued for `{name}`; retry later.")

    def submit(
        self, served: ServedModel, prompt_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queues a request checked by `served.check`; raises APIError (503) before anything is
        accepted. Iterate the stream for its deltas; close it to abort."""
        self._admit(served)
        stream = RequestStream(self, served)
        stream.max_tokens = params.max_tokens
        stream.request = self.engine.submit(served, prompt_ids, params, stream.sink, stream.arrival)
        self._queued[served.name] += 1
        self._open.add(stream)
        self.metrics.pending.labels(served.name).inc()
        self.in_flight += 1
        self._idle.clear()
        return stream

    def _started(self, stream: RequestStream) -> None:
        self._queued[stream.model] -= 1

    def _closed(self, stream: RequestStream) -> None:
        if stream.queued:  # closed before any output: still counted as queued
            self._queued[stream.model] -= 1
            self.metrics.pending.labels(stream.model).dec()
        if not stream.finished:
            self.engine.abort(stream.model, stream.request.request_id)
            self.metrics.request_success.labels(stream.model, "abort").inc()
        self._open.discard(stream)
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _ended(self, stream: RequestStream, out: RequestOutput) -> None:
        """A request's final output arrived (whether or not its client still listens): where
        its time went, to the metrics and the request log."""
        if out.waits:
            self.metrics.waited(stream.model, out.waits)
        if self.request_log is not None and stream.response_id is not None:
            self.request_log.write(
                record(stream.response_id, stream.model, out, stream.arrival, stream.index)
            )

    def close(self) -> None:
        """At shutdown, after the last request ended: the request log's file."""
        if self.request_log is not None:
            self.request_log.close()

    def abort_all(self) -> None:
        """Abort every request in flight (the shutdown deadline): each still ends through its
        stream, with finish_reason abort."""
        for stream in list(self._open):
            if not stream.finished:
                self.engine.abort(stream.model, stream.request.request_id)

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

    def __init__(self, owner: Frontend, served: ServedModel):
        self.owner, self.served, self.model = owner, served, served.name
        self.request = None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.queued = True  # no output yet
        self.scheduled: float | None = None  # when it first ran
        self.max_tokens: int | None = None
        self.ready = asyncio.Event()  # set at the first output
        self.finished = False
        self.closed = False
        # the response the client sees: its id and this request's choice in it (None: the only)
        self.response_id: str | None = None
        self.index: int | None = None

    @property
    def has_output(self) -> bool:
        return self.ready.is_set()

    def _put(self, out: RequestOutput) -> None:
        self.ready.set()
        self.queue.put_nowait(out)
        if out.finished:
            self.owner._ended(self, out)

    def sink(self, out: RequestOutput) -> None:  # engine thread
        if self.loop.is_closed():  # the server is gone (shutdown): nobody is listening
            return
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            self.loop.call_soon_threadsafe(self._put, out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        out = await self.queue.get()
        now = time.monotonic()
        metrics, spec = self.owner.metrics, self.served.spec
        if out.first_scheduled_time is not None:
            self.scheduled = out.first_scheduled_time
        if self.queued:
            self.queued = False
            self.owner._started(self)
            metrics.started(self.model, out, self.arrival, now, spec.ttft_slo_ms)
        if out.new_token_ids:
            gap = None if self.last_token is None else now - self.last_token
            metrics.tokens(self.model, len(out.new_token_ids), gap)
            self.first_token = self.first_token or now
            self.last_token = now
        if out.finished:
            self.finished = True
            metrics.finished(
                self.model,
                out,
                self.arrival,
                self.first_token,
                now,
                spec.tpot_slo_ms,
                self.scheduled,
                self.max_tokens,
            )
            self.close()
        return out

    def close(self) -> None:
        """Releases the request; aborts it in the engine if it has not finished."""
        if self.closed:
            return
        self.closed = True
        self.owner._closed(self)
