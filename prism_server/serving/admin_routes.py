"""Admin routes (behind the API key when one is set): move a model in or out of the GPU now.

    POST /v1/models/{id}/activate   -> {"id", "state": "resident", "seconds"}
    POST /v1/models/{id}/evict      -> {"id", "state": "offloaded", "seconds"}

vLLM's /wake_up and /sleep, llama-swap's /unload. They return once the transition is done (its
future awaited on the event loop, no thread held); 409 with the envelope when it cannot be done
now (a pinned model, no room even after evicting every idle model, or an eviction whose model was
activated while it drained)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from prism_server.engine.commands import TransitionRefused
from prism_server.engine.engine import Engine
from prism_server.serving import serving
from prism_server.serving.protocol import APIError


class AdminRoutes:
    def __init__(self, engine: Engine):
        self.engine = engine

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/models/{model_id:.+}/activate", self.activate)
        app.router.add_post("/v1/models/{model_id:.+}/evict", self.evict)

    async def activate(self, request: web.Request) -> web.Response:
        return await self._transition(request, self.engine.start_activate, "resident")

    async def evict(self, request: web.Request) -> web.Response:
        return await self._transition(request, self.engine.start_evict, "offloaded")

    async def _transition(self, request: web.Request, start, state: str) -> web.Response:
        """Send the transition and await its future on the loop (no thread waits for it)."""
        name = request.match_info["model_id"]
        serving.lookup(self.engine, name)
        t = time.perf_counter()
        try:
            # shielded: a client that goes away does not cancel the transition
            await asyncio.shield(asyncio.wrap_future(start(name)))
        except TransitionRefused as e:
            raise APIError(409, str(e), param="model", code="transition_refused") from None
        seconds = time.perf_counter() - t
        return web.json_response({"id": name, "state": state, "seconds": round(seconds, 6)})
