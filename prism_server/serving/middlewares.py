"""What every request passes before a handler: the access log line, the error envelope (and the
end of a started stream), the Host and Content-Type checks that stop cross-site and DNS-rebinding
requests, and API-key auth. Client headers are validated here before anything uses them."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time

from aiohttp import web

from prism_server.logs import ACCESS
from prism_server.serving.protocol import APIError, error_body
from prism_server.serving.sse import current_stream

log = logging.getLogger(__name__)

_OPEN_PATHS = frozenset({"/health", "/dashboard"})  # the dashboard's assets hold no data
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
MAX_REQUEST_ID = 256
# what a generation handler leaves on its request for the access line: the model, and
# (prompt tokens, completion tokens)
MODEL = web.RequestKey("prism_model", str)
USAGE = web.RequestKey("prism_usage", tuple)


def error_response(
    status: int, message: str, type_: str, code: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.json_response(error_body(message, type_, None, code), status=status, headers=headers)


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id if it is printable ASCII of at most 256 characters; anything
    else is ignored (neither echoed nor used)."""
    rid = request.headers.get("X-Request-Id")
    if rid and len(rid) <= MAX_REQUEST_ID and rid.isascii() and rid.isprintable():
        return rid
    return None


def is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_names(bind_host: str, allowed: tuple[str, ...] | None) -> frozenset[str] | None:
    """Host names a request's Host header may carry; None = any. Default (allowed is None): a
    loopback bind accepts only loopback names (so DNS rebinding fails), any other bind any name.
    `allowed` extends the loopback names; "*" turns the check off."""
    if allowed is not None and "*" in allowed:
        return None
    if allowed is None and not is_loopback(bind_host):
        return None
    names = set(allowed or ())
    if is_loopback(bind_host):
        names |= _LOOPBACK_NAMES
    names.add(bind_host)
    return frozenset(n.lower() for n in names)


def _host_name(header: str) -> str:
    """ "Host: name:port" or "[v6]:port" -> the name, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def middlewares(
    api_key: str | None,
    allowed_hosts: frozenset[str] | None,
    access_log: bool = False,
    cors: bool = False,
) -> list:
    """access_log: a line per request (`prism.access`); cors: CORS preflights pass the API-key
    check (browsers send no credentials in them)."""

    @web.middleware
    async def access(request: web.Request, handler):
        start = time.monotonic()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away
            raise
        finally:
            _log_access(request, status, time.monotonic() - start)

    @web.middleware
    async def errors(request: web.Request, handler):
        current_stream.set(None)
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:
            sse = current_stream.get()
            if sse is not None and sse.started:  # never a second response inside the first
                if not isinstance(e, APIError):
                    log.exception("error in a started stream on %s", request.path)
                await sse.fail(e.message if isinstance(e, APIError) else "Internal server error.")
                return sse.response
            return _as_response(request, e)

    @web.middleware
    async def guard(request: web.Request, handler):
        if allowed_hosts is not None:
            host = request.headers.get("Host")
            if host is not None and (not host.isascii() or _host_name(host) not in allowed_hosts):
                return error_response(
                    403,
                    "The Host header names a host this server does not answer for.",
                    "invalid_request_error",
                    "host_not_allowed",
                )
        return await handler(request)

    @web.middleware
    async def media(request: web.Request, handler):  # after auth: no 415 before a 401
        if request.method == "POST" and request.content_type != "application/json":
            return error_response(
                415,
                "The request body must be JSON, sent with Content-Type: application/json.",
                "invalid_request_error",
                "unsupported_media_type",
            )
        return await handler(request)

    @web.middleware
    async def auth(request: web.Request, handler):
        preflight = cors and request.method == "OPTIONS"
        open_ = request.path in _OPEN_PATHS or request.path.startswith("/dashboard/")
        if api_key is not None and not open_ and not preflight:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            try:
                given = token.encode("utf-8")
            except UnicodeEncodeError:  # bytes that are not UTF-8: not our key
                given = b""
            ok = scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())
            if not ok:
                return error_response(
                    401,
                    "Invalid or missing API key (Authorization: Bearer <key>).",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        return await handler(request)

    inner = [errors, guard, auth, media]
    return [access, *inner] if access_log else inner


def _log_access(request: web.Request, status: int, seconds: float) -> None:
    usage = request.get(USAGE)
    fields = {
        "method": request.method,
        "path": request.path,
        "status": status,
        "model": request.get(MODEL),
        "prompt_tokens": usage[0] if usage else None,
        "completion_tokens": usage[1] if usage else None,
        "seconds": round(seconds, 4),
        "remote": request.remote,
    }
    tokens = f" tokens={usage[0]}+{usage[1]}" if usage else ""
    model = f" model={fields['model']}" if fields["model"] else ""
    ACCESS.info(
        "%s %s %s %d%s%s %.3fs",
        request.remote,
        request.method,
        request.path,
        status,
        model,
        tokens,
        seconds,
        extra=fields,
    )


def _as_response(request: web.Request, e: Exception) -> web.StreamResponse:
    if isinstance(e, APIError):
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    if isinstance(e, web.HTTPException):
        if e.status < 400:
            raise e
        type_ = "invalid_request_error" if e.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = e.reason if e.status != 404 else f"No route for {request.method} {request.path}."
        allow = e.headers.get("Allow")  # a 405's methods
        headers = {"Allow": allow} if allow else None
        return error_response(e.status, message, type_, code.get(e.status), headers)
    log.exception("internal error on %s %s", request.method, request.path, exc_info=e)
    return error_response(500, "Internal server error.", "server_error")
