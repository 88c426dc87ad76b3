"""Server-sent events: `data: <json>` + blank line per event, `data: [DONE]` last."""

from __future__ import annotations

import json

from aiohttp import web


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

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
