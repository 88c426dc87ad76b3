"""The aiohttp application: routes, the error envelope, API-key auth, graceful shutdown; `serve`
runs it, `serve_in_thread` runs it on its own event loop thread (tests, soak, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from prism_server.engine.engine import Engine
from prism_server.server_args import ServerArgs
from prism_server.serving.admin_routes import AdminRoutes
from prism_server.serving.frontend import Frontend
from prism_server.serving.middlewares import allowed_host_names, client_request_id, middlewares
from prism_server.serving.openai_routes import OpenAIRoutes
from prism_server.serving.status import status

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).parent / "dashboard"  # the page and its assets, shipped in the package

FRONTEND = web.AppKey("frontend", Frontend)
# After the shutdown deadline: how long aborted requests get to send their last event, and how
# long aiohttp then waits for handlers before it cancels them.
_ABORT_GRACE_S = 3.0
_HANDLER_GRACE_S = 1.0


def build_app(engine: Engine, args: ServerArgs) -> web.Application:
    frontend = Frontend(engine, args.max_queued_requests, args.request_log)
    hosts = allowed_host_names(args.host, args.allowed_hosts)
    app = web.Application(
        middlewares=middlewares(
            args.api_key, hosts, access_log=args.access_log, cors=bool(args.cors_origins)
        ),
        client_max_size=args.max_request_bytes,
    )
    app[FRONTEND] = frontend
    AdminRoutes(engine).register(app)
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
        rid = client_request_id(request)
        if rid:
            response.headers.setdefault("X-Request-Id", rid)

    async def status_route(request: web.Request) -> web.Response:
        return web.json_response(status(engine))

    app.on_response_prepare.append(echo_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status_route)

    async def dashboard(request: web.Request) -> web.FileResponse:
        return web.FileResponse(DASHBOARD / "index.html")

    app.router.add_get("/dashboard", dashboard)
    app.router.add_static("/dashboard/", DASHBOARD)
    if args.cors_origins:
        _cors(app, args.cors_origins)
    return app


def _cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Browsers at `origins` may call every route (preflights answered, any header and method
    allowed, no credentials: the API key travels in a header)."""
    import aiohttp_cors

    opts = aiohttp_cors.ResourceOptions(
        allow_credentials=False, expose_headers="*", allow_headers="*", allow_methods="*"
    )
    cors = aiohttp_cors.setup(app, defaults={o: opts for o in origins})
    for route in list(app.router.routes()):
        cors.add(route)


async def serve(
    engine: Engine, args: ServerArgs, ready=None, stop: asyncio.Event | None = None
) -> None:
    """Runs until SIGTERM/SIGINT (or `stop` is set), then drains in-flight requests (up to the
    shutdown timeout). `ready(port)` is called once the socket listens."""
    app = build_app(engine, args)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_HANDLER_GRACE_S
    )
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
        frontend.abort_all()  # each ends with finish_reason abort (and [DONE] when streamed)
        if not await frontend.drain(_ABORT_GRACE_S):
            log.warning("%d requests did not end after their abort", frontend.in_flight)
    await runner.cleanup()
    frontend.close()


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
