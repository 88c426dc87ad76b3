"""The aiohttp application: routes, the error envelope, API-key auth, graceful shutdown; `serve`
runs it, `serve_in_thread` runs it on its own event loop thread (tests, soak, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
from dataclasses import dataclass

from aiohttp import web

from prism_server.engine import Engine
from prism_server.protocol import APIError, error_body
from prism_server.server.frontend import Frontend
from prism_server.server.openai_routes import OpenAIRoutes
from prism_server.server_args import ServerArgs

log = logging.getLogger(__name__)

FRONTEND = web.AppKey("frontend", Frontend)
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
    frontend = Frontend(engine, args.max_queued_requests)
    app = web.Application(
        middlewares=_middlewares(args.api_key), client_max_size=args.max_request_bytes
    )
    app[FRONTEND] = frontend
    OpenAIRoutes(frontend).register(app)

    async def health(request: web.Request) -> web.Response:
        if frontend.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=frontend.metrics.render(),
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
    frontend = app[FRONTEND]
    log.info("shutting down: draining %d in-flight requests", frontend.in_flight)
    if not await frontend.drain(args.shutdown_timeout_s):
        log.warning("shutdown timeout: %d requests still in flight are aborted", frontend.in_flight)
    await runner.cleanup()


@dataclass
class ServerThread:
    """A server running on its own event loop thread; `close()` stops it (draining first)."""

    engine: Engine
    url: str
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    thread: threading.Thread

    def close(self, close_engine: bool = True) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=60)
        if close_engine:
            self.engine.close()


def serve_in_thread(engine: Engine, args: ServerArgs | None = None, **fields) -> ServerThread:
    """Serve `engine` on 127.0.0.1 and a free port (unless `args` say otherwise) from a thread;
    returns once the socket listens. `fields` override ServerArgs fields."""
    from dataclasses import replace

    args = args or ServerArgs(port=0, engine=engine.config)
    args = replace(args, **fields) if fields else args
    started = threading.Event()
    box: dict = {}

    async def main():
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await serve(
            engine,
            args,
            ready=lambda port: (box.update(port=port), started.set()),
            stop=box["stop"],
        )

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="prism-http", daemon=True)
    thread.start()
    if not started.wait(60):
        raise RuntimeError("the server did not start within 60 s")
    url = f"http://{args.host}:{box['port']}"
    return ServerThread(engine, url, box["loop"], box["stop"], thread)
