"""Admin routes (behind the API key when one is set): move a model in or out of the GPU now.

    POST /v1/models/{id}/activate   -> {"id", "state": "resident", "seconds"}
    POST /v1/models/{id}/evict      -> {"id", "state": "offloaded", "seconds"}
    POST /v1/load_lora_adapter      {"lora_name", "lora_path"[, "base"]} -> 200, a text line
    POST /v1/unload_lora_adapter    {"lora_name"} -> 200 once its requests have finished

vLLM's /wake_up and /sleep, llama-swap's /unload. They return once the transition is done (its
future awaited on the event loop, no thread held); 409 with the envelope when it cannot be done
now (a pinned model, no room even after evicting every idle model, or an eviction whose model was
activated while it drained). The LoRA routes are vLLM's (names, bodies, text answers); a bad
adapter is refused with 400 naming the problem, nothing served disturbed."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from prism_server.engine.commands import TransitionRefused
from prism_server.engine.engine import AdapterError, Engine
from prism_server.served_model import ModelNotFound
from prism_server.serving import serving
from prism_server.serving.protocol import APIError


class AdminRoutes:
    def __init__(self, engine: Engine):
        self.engine = engine

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/models/{model_id:.+}/activate", self.activate)
        app.router.add_post("/v1/models/{model_id:.+}/evict", self.evict)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)

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

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's body: lora_name, lora_path; Prism's `base` (optional): the model it adapts
        (default: the one its adapter_config.json names, or the only one)."""
        body = await _body(request, required=("lora_name", "lora_path"), optional=("base",))
        name, path = body["lora_name"], body["lora_path"]
        if self.engine.served.get(name) is not None:
            raise APIError(
                400,
                f"The model `{name}` is already served; unload it first to load another.",
                param="lora_name",
                code="invalid_adapter",
            )
        try:
            done = self.engine.adapters.start_load(name, path, body.get("base"))
            await asyncio.shield(asyncio.wrap_future(done))
        except (AdapterError, ValueError) as e:
            raise serving.bad_adapter(e) from None
        except MemoryError as e:  # a good adapter the pool has no room for now
            raise APIError(
                503, str(e), "server_error", param="lora_path", code="insufficient_memory"
            ) from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """Requests for it get 404 at once; those accepted finish first (the answer waits)."""
        body = await _body(request, required=("lora_name",), optional=("lora_int_id",))
        name = body["lora_name"]
        try:
            done = self.engine.adapters.start_unload(name)
        except ModelNotFound:
            raise APIError(
                404,
                f"The LoRA adapter `{name}` is not loaded.",
                param="lora_name",
                code="model_not_found",
            ) from None
        await asyncio.shield(asyncio.wrap_future(done))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _body(request: web.Request, required: tuple, optional: tuple) -> dict:
    """A JSON object with the `required` string fields (and maybe the `optional` ones): 400
    naming the field otherwise."""
    body = await serving.read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.")
    for key in body:
        if key not in required and key not in optional:
            raise APIError(400, f"Unknown field `{key}`.", param=key)
    for key in required:
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"`{key}` is required (a non-empty string).", param=key)
    return body
