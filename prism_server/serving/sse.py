"""Server-sent events: `data: <json>` + blank line per event, `data: [DONE]` last.

Once `prepare` has sent the 200, the response can only end as the SSE contract says: a failure
becomes `data: {"error": ...}` then `data: [DONE]` (`fail`), never a second HTTP response. The
writer records itself in `current_stream` (a context variable: the handler's task) so the error
middleware can find a started stream."""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar

from aiohttp import web

from prism_server.serving.protocol import stream_error

log = logging.getLogger(__name__)

current_stream: ContextVar[SSEWriter | None] = ContextVar("current_stream", default=None)


class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        self.done_sent = False

    @property
    def started(self) -> bool:
        return self.response.prepared

    async def prepare(self) -> None:
        current_stream.set(self)
        await self.response.prepare(self.request)

    async def send(self, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def comment(self, text: str) -> None:
        """A comment line (`: text`): clients ignore it, proxies see a live stream."""
        await self.response.write(f": {text}\n\n".encode())

    async def done(self) -> None:
        self.done_sent = True
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, message: str) -> None:
        """End a started stream with an error event and [DONE] (once; the client may be gone)."""
        if self.done_sent:
            return
        try:
            await self.send(stream_error(message))
            await self.done()
        except (ConnectionError, RuntimeError) as e:  # the client went away: nothing to tell
            log.info("stream closed before its error could be sent: %s", e)
            self.done_sent = True
