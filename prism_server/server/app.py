"""The aiohttp application: routes, the error envelope, API-key auth, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal

from aiohttp import web

from prism_server.engine import Engine
from prism_server.protocol import APIError, error_body
from prism_server.server.async_engine import AsyncEngine
from prism_server.server.openai_routes import OpenAIRoutes
from prism_server.server_args import ServerArgs

log = logging.getLogger(__name__)

AENGINE = web.AppKey("aengine", AsyncEngine)
_OPEN_PATHS = frozenset({"/health"})


def _error(
    status: int, message: str, type_: str, code: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.json_response(error_body(message, type_, None, code), status=status, headers=headers)


def _middlewares(api_key: str | None):
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            return _error(
                e.status,
                e.reason if e.status != 404 else f"No route for {request.method} {request.path}.",
                type_,
                code.get(e.status),
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(500, "Internal server error.", "server_error")

    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key is not None and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.encode(), api_key.encode()
            )
            if not ok:
                return _error(
                    401,
                    "Invalid or missing API key (Authorization: Bearer <key>).",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        return await handler(request)

    return [errors, auth]


def build_app(engine: Engine, args: ServerArgs) -> web.Application:
    aengine = AsyncEngine(engine, args.max_queued_requests)
    app = web.Application(
        middlewares=_middlewares(args.api_key), client_max_size=args.max_request_bytes
    )
    app[AENGINE] = aengine
    OpenAIRoutes(aengine).register(app)

    async def health(request: web.Request) -> web.Response:
        if aengine.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=aengine.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
        rid = request.headers.get("X-Request-Id")
        if rid:
            response.headers.setdefault("X-Request-Id", rid)

    app.on_response_prepare.append(echo_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(
    engine: Engine, args: ServerArgs, ready=None, stop: asyncio.Event | None = None
) -> None:
    """Runs until SIGTERM/SIGINT (or `stop` is set), then drains in-flight requests (up to the
    shutdown timeout). `ready(port)` is called once the socket listens."""
    app = build_app(engine, args)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(port)
    await stop.wait()
    aengine = app[AENGINE]
    log.info("shutting down: draining %d in-flight requests", aengine.in_flight)
    if not await aengine.drain(args.shutdown_timeout_s):
        log.warning("shutdown timeout: %d requests still in flight are aborted", aengine.in_flight)
    await runner.cleanup()
