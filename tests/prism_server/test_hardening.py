"""A hostile or careless client: late failures inside a started stream, headers that are not
what they claim, text that is not valid Unicode, cross-site and DNS-rebinding requests, field
combinations OpenAI refuses, batches that can never be queued. Each case asserts the exact
status and envelope, and that the server keeps answering correctly afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving import protocol
from prism_server.serving.app import serve_in_thread
from prism_server.serving.middlewares import allowed_host_names

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def srv():
    spec = ModelSpec("tiny", "dummy:tiny-llama", block_size=4, max_queued_requests=8)
    engine = Engine(
        EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, kv_budget_bytes=4 << 20)
    )
    s = serve_in_thread(engine, api_key="sekret", max_queued_requests=64)
    yield s
    s.close()


AUTH = {"Authorization": "Bearer sekret"}


def post(s, path: str, body=None, headers=None, content: bytes | None = None) -> httpx.Response:
    h = {**AUTH, **(headers or {})}
    if content is None:
        content = json.dumps(body).encode()  # ASCII escapes: lone surrogates survive as JSON
        h.setdefault("Content-Type", "application/json")
    return httpx.post(s.url + path, content=content, headers=h, timeout=60)


def stream_lines(s, path: str, body: dict, headers=None) -> tuple[httpx.Response, list[str]]:
    h = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    with httpx.stream(
        "POST", s.url + path, content=json.dumps(body).encode(), headers=h, timeout=60
    ) as r:
        return r, [x for x in r.iter_lines() if x]


def envelope(r: httpx.Response, status: int, code: str | None = None, param=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def still_serving(s) -> None:
    r = post(s, "/v1/completions", {**CMPL, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    _, lines = stream_lines(s, "/v1/chat/completions", {**CHAT, "stream": True})
    assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    s.engine.check_integrity()


# ---- failures after the 200 has gone out ---------------------------------------------------
def _raise(*a, **k):
    raise RuntimeError("injected late fault")


@pytest.mark.parametrize(
    "path, body, where",
    [
        ("/v1/chat/completions", CHAT, "ChatShapes.first"),
        ("/v1/chat/completions", CHAT, "ChatShapes.delta"),
        ("/v1/completions", {**CMPL, "echo": True}, "CompletionShapes.first"),
        ("/v1/completions", CMPL, "CompletionShapes.delta"),
        ("/v1/completions", {**CMPL, "n": 3}, "CompletionShapes.delta"),
        (
            "/v1/completions",
            {**CMPL, "stream_options": {"include_usage": True}},
            "_Shapes.chunk@usage",
        ),
    ],
)
def test_a_late_exception_ends_the_stream_as_sse_says(srv, monkeypatch, path, body, where):
    cls_name, _, fn = where.partition(".")
    fn, _, when = fn.partition("@")
    cls = getattr(protocol.responses, cls_name)
    original = getattr(cls, fn)
    if when == "usage":  # only the usage chunk (the one with choices=[]) fails

        def late(self, choices, usage_=None):
            if usage_ is not None:
                _raise()
            return original(self, choices, usage_)

        monkeypatch.setattr(cls, fn, late)
    else:
        monkeypatch.setattr(cls, fn, _raise)
    r, lines = stream_lines(srv, path, {**body, "stream": True})
    assert r.status_code == 200
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    err = json.loads(lines[-2][len("data: ") :])["error"]
    assert err["type"] == "server_error" and "Internal server error" in err["message"]
    assert not any("HTTP/1.1" in x for x in lines)
    monkeypatch.undo()
    still_serving(srv)


def test_a_late_exception_in_a_whole_response_is_one_500(srv, monkeypatch):
    monkeypatch.setattr(protocol.CompletionShapes, "whole", _raise)
    envelope(post(srv, "/v1/completions", CMPL), 500)
    monkeypatch.undo()
    still_serving(srv)


# ---- headers -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rid",
    [b"\xff\xfe", b"caf\xc3\xa9", b"x" * 257, b"a\tb"],
    ids=["not-utf8", "non-ascii", "too-long", "tab"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_request_id_is_ignored_not_echoed(srv, rid, stream):
    headers = {"X-Request-Id": rid}
    if stream:
        r, lines = stream_lines(srv, "/v1/completions", {**CMPL, "stream": True}, headers)
        assert lines[-1] == "data: [DONE]"
        rid_out = json.loads(lines[0][6:])["id"]
    else:
        r = post(srv, "/v1/completions", CMPL, headers)
        assert r.status_code == 200
        rid_out = r.json()["id"]
    assert "X-Request-Id" not in r.headers
    assert rid_out.startswith("cmpl-")
    still_serving(srv)


def test_a_good_request_id_is_echoed(srv):
    r = post(srv, "/v1/completions", CMPL, {"X-Request-Id": "trace-42/ok"})
    assert r.headers["X-Request-Id"] == "trace-42/ok" and r.json()["id"] == "trace-42/ok"


@pytest.mark.parametrize(
    "value",
    [b"Bearer \xff\xfe", b"Bearer s\xc3\xa9kret", b"\xff", b"Bearer", b"Basic sekret", b""],
)
def test_credentials_that_are_not_the_key_get_401(srv, value):
    r = httpx.post(
        srv.url + "/v1/completions",
        json=CMPL,
        headers={"Authorization": value},
        timeout=60,
    )
    envelope(r, 401, "invalid_api_key")
    still_serving(srv)


# ---- text that is not valid Unicode ----------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [
                    {"role": "system", "content": "a" + SURROGATE},
                    {"role": "user", "content": "hi"},
                ],
            },
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}],
            },
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
            "messages.0.name",
        ),
        ("/v1/chat/completions", {**CHAT, "stop": ["ok", SURROGATE]}, "stop.1"),
        ("/v1/chat/completions", {**CHAT, "user": SURROGATE}, "user"),
        ("/v1/completions", {**CMPL, "prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {**CMPL, "prompt": ["fine", "bad" + SURROGATE]}, "prompt.1"),
        ("/v1/completions", {**CMPL, "model": "tiny" + SURROGATE}, "model"),
        ("/v1/completions", {**CMPL, SURROGATE: 1}, "\\ud800"),  # a key, named escaped
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_unicode_is_400_naming_the_field(srv, path, body, param, stream):
    r = post(srv, path, {**body, "stream": stream})
    err = envelope(r, 400)
    assert "not valid Unicode" in err["message"] and err["param"] == param
    still_serving(srv)


def test_noncharacters_and_long_text_are_valid_unicode(srv):
    odd = "\uffff\ufffe\ufdd0\U0010ffff\x00 " * 50
    r = post(srv, "/v1/completions", {**CMPL, "prompt": odd[:200]})
    assert r.status_code in (200, 400)  # 400 only for length, never for the characters
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    still_serving(srv)


# ---- cross-site requests -------------------------------------------------------------------
@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        None,
    ],
)
def test_post_bodies_must_be_json(srv, ctype):
    headers = {} if ctype is None else {"Content-Type": ctype}
    r = post(srv, "/v1/completions", headers=headers, content=json.dumps(CMPL).encode())
    envelope(r, 415, "unsupported_media_type")
    still_serving(srv)


def test_json_with_a_charset_is_json(srv):
    r = post(srv, "/v1/completions", CMPL, {"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example"])
def test_a_foreign_host_header_is_refused_on_a_loopback_bind(srv, host):
    r = httpx.get(srv.url + "/v1/models", headers={**AUTH, "Host": host}, timeout=30)
    envelope(r, 403, "host_not_allowed")
    r = httpx.get(srv.url + "/health", headers={"Host": host}, timeout=30)
    envelope(r, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "[::1]:1"])
def test_loopback_host_headers_are_answered(srv, host):
    r = httpx.get(srv.url + "/v1/models", headers={**AUTH, "Host": host}, timeout=30)
    assert r.status_code == 200


def test_the_host_allow_list():
    loop = {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names("127.0.0.1", None) == loop
    assert allowed_host_names("127.0.0.1", ("Prism.Internal",)) == loop | {"prism.internal"}
    assert allowed_host_names("127.0.0.1", ("*",)) is None
    assert allowed_host_names("0.0.0.0", None) is None  # a public bind answers any name
    assert allowed_host_names("0.0.0.0", ("gw.example",)) == {"gw.example", "0.0.0.0"}
    assert allowed_host_names("::1", None) == loop


def test_an_allow_listed_host_is_answered():
    spec = ModelSpec("tiny", "dummy:tiny-llama", block_size=4)
    engine = Engine(
        EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, kv_budget_bytes=2 << 20)
    )
    s = serve_in_thread(engine, allowed_hosts=("prism.internal",))
    try:
        ok = httpx.get(s.url + "/health", headers={"Host": "prism.internal:8000"}, timeout=30)
        assert ok.status_code == 200
        envelope(httpx.get(s.url + "/health", headers={"Host": "other"}, timeout=30), 403)
    finally:
        s.close()


# ---- field combinations and bounds ---------------------------------------------------------
def test_top_logprobs_needs_logprobs(srv):
    envelope(
        post(srv, "/v1/chat/completions", {**CHAT, "top_logprobs": 2}), 400, param="top_logprobs"
    )
    body = {**CHAT, "top_logprobs": 2, "logprobs": False}
    envelope(post(srv, "/v1/chat/completions", body), 400, param="top_logprobs")
    r = post(srv, "/v1/chat/completions", {**CHAT, "top_logprobs": 2, "logprobs": True})
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)])
def test_stream_options_needs_stream(srv, path, body):
    opts = {"stream_options": {"include_usage": True}}
    envelope(post(srv, path, {**body, **opts}), 400, param="stream_options")
    envelope(post(srv, path, {**body, **opts, "stream": False}), 400, param="stream_options")
    r, lines = stream_lines(srv, path, {**body, **opts, "stream": True, "ignore_eos": True})
    assert r.status_code == 200 and json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4


def test_a_batch_beyond_the_queue_bound_is_400_not_retry_later(srv):
    body = {**CMPL, "prompt": ["a", "b", "c"], "n": 3}  # 9 completions; the model queues 8
    err = envelope(post(srv, "/v1/completions", body), 400, "too_many_completions", "n")
    assert "at most 8" in err["message"] and "tiny" in err["message"]
    body = {**CMPL, "prompt": ["a", "b"], "n": 4}  # 8: fits
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    still_serving(srv)
