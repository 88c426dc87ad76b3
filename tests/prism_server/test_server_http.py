"""The server over raw HTTP: the error matrix, SSE framing, disconnects, overload, auth, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"
CHAT = {"model": SMOL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}


def post(url: str, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        kw["json"] = body
    else:
        kw["content"] = body
        kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
    return httpx.post(url + path, timeout=120, **kw)


def assert_envelope(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"\xff\xfe", None),
        ({"model": SMOL}, "messages"),
        ({"model": SMOL, "messages": []}, "messages"),
        ({"model": SMOL, "messages": "hi"}, "messages"),
        ({"model": SMOL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 10**30}, "max_tokens"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "stop": [""]}, "stop"),
        ({**CHAT, "stop": ["x"] * 100}, "stop"),
        ({**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        # wrong JSON types are refused, not coerced
        ({**CHAT, "temperature": "0.5"}, "temperature"),
        ({**CHAT, "n": "2"}, "n"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stop": [1, 2]}, "stop"),
        (json.dumps({**CHAT, "temperature": float("nan")}).encode(), "temperature"),
        (b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # nested too deep
        # known fields that would need what Prism does not do
        ({**CHAT, "store": True}, "store"),
        ({**CHAT, "service_tier": "flex"}, "service_tier"),
        ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ({**CHAT, "use_beam_search": True}, "use_beam_search"),
        ({**CHAT, "response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({**CHAT, "continue_final_message": True}, "continue_final_message"),
        ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}}, "stream_opt"),
    ],
)
def test_bad_requests_get_400_with_the_envelope(server, body, param):
    err = assert_envelope(post(server.url, body), 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"].startswith(param)


def test_context_length_unknown_model_and_unknown_route(server):
    assert_envelope(post(server.url, {**CHAT, "max_tokens": 10**6}), 400, "context_length_exceeded")
    err = assert_envelope(post(server.url, {**CHAT, "model": "gpt-9"}), 404, "model_not_found")
    assert err["message"] == "The model `gpt-9` does not exist."
    assert_envelope(httpx.get(server.url + "/v1/models/gpt-9"), 404, "model_not_found")
    assert_envelope(httpx.get(server.url + "/v2/nothing"), 404)
    r = httpx.get(server.url + "/v1/chat/completions")
    assert_envelope(r, 405) and "POST" in r.headers["Allow"]
    bad_ids = {"model": SMOL, "prompt": [10**9], "max_tokens": 2}
    assert_envelope(post(server.url, bad_ids, "/v1/completions"), 400)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_request_id_is_honoured(server):
    r = post(server.url, CHAT, headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123" and r.json()["id"] == "abc-123"


def test_unknown_fields_are_refused_and_null_is_a_fields_default(server):
    err = assert_envelope(post(server.url, {**CHAT, "frobnicate": True}), 400)
    assert err["param"] == "frobnicate"
    assert err["message"] == "Unrecognized request argument supplied: frobnicate"
    cmpl = {"model": SMOL, "prompt": "Hi", "max_tokens": 2, "top_logprobs": 2}
    assert (
        assert_envelope(post(server.url, cmpl, "/v1/completions"), 400)["param"] == "top_logprobs"
    )
    bools = {**cmpl, "top_logprobs": None, "prompt": [True]}
    err = assert_envelope(post(server.url, bools, "/v1/completions"), 400)
    assert err["message"].startswith("prompt: Input should be a string, a list of strings")
    nulls = dict.fromkeys(["n", "stream", "logprobs", "frequency_penalty", "min_tokens", "seed"])
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": []}
    messages = [*CHAT["messages"], echoed, {"role": "user", "content": "Hi", "extra": 1}]
    fields = {"user": "u", "store": False, "service_tier": "auto", "metadata": None}
    r = post(server.url, {**CHAT, **nulls, **fields, "messages": messages})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1  # n: null is n: 1


def sse_events(r: httpx.Response) -> list:
    """Every event of a stream, parsed; checks the framing on the way (a comment line, the
    keep-alive of a slow first token, is no event)."""
    events, buf = [], []
    for line in r.iter_lines():
        if line.startswith(":") and not buf:
            continue
        if line:
            buf.append(line)
            continue
        assert len(buf) == 1 and buf[0].startswith("data: "), buf
        data = buf[0][len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
        buf = []
    assert not buf
    return events


def test_sse_framing_chat_and_completions(server):
    body = {
        **CHAT,
        "max_tokens": 12,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] > 0
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"]["role"] == "assistant"
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] in ("stop", "length")
    body = {"model": GEMMA, "prompt": "Once upon", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def wait_idle(engine: Engine, model: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.model_snapshot(model, now=False).num_requests:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_blocks(server):
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in seen)
        assert server.engine.model_snapshot(SMOL).kv_blocks_held > 0
    wait_idle(server.engine, SMOL)  # the client is gone: the request was aborted
    assert server.engine.model_snapshot(SMOL).kv_blocks_held == 0
    server.engine.check_integrity()


@pytest.mark.slow
def test_requests_to_two_models_interleave(server):
    """One model's stream goes on while the other's runs from its first token to its last:
    the device steps both, not one to its end (the start of the second stream may lag the
    first by any time on a loaded machine, so the first stream runs until the second ends)."""
    common = {"ignore_eos": True, "stream": True, "temperature": 0}
    long_body = {"model": GEMMA, "prompt": "Once", "max_tokens": 2000, **common}
    short_body = {**CHAT, "max_tokens": 24, **common}
    long_times: list[float] = []
    short_times: list[float] = []
    short_done = threading.Event()

    def short() -> None:
        url = server.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=short_body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    short_times.append(time.monotonic())
        short_done.set()

    with httpx.stream("POST", server.url + "/v1/completions", json=long_body, timeout=120) as r:
        t = threading.Thread(target=short)
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            done = short_done.is_set()  # before the time is taken: it is after the short's last
            long_times.append(time.monotonic())
            if len(long_times) == 2:
                t.start()  # the long stream is under way
            if done:
                break  # the client leaves: the long request is aborted
        t.join()
    assert short_done.is_set() and len(short_times) >= 16  # tokens with no text send no event
    # the long stream made progress all through the short one
    assert long_times[0] < short_times[0] and short_times[-1] < long_times[-1]
    assert sum(short_times[0] < x < short_times[-1] for x in long_times) >= 5
    wait_idle(server.engine, GEMMA)
    server.engine.check_integrity()


def test_metrics_are_exported(server):
    post(server.url, CHAT)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "prism:num_requests_running",
        "prism:num_requests_waiting",
        "prism:kv_cache_usage_perc",
        "prism:prompt_tokens_total",
        "prism:generation_tokens_total",
        "prism:request_success_total",
        "prism:time_to_first_token_seconds_bucket",
        "prism:inter_token_latency_seconds_bucket",
        "prism:e2e_request_latency_seconds_count",
        "prism:request_queue_time_seconds_count",
        "prism:model_kv_pages",
        "prism:model_memory_bytes",
        "prism:device_pool_pages",
        "prism:device_pool_bytes",
    ):
        assert name in text, name
    assert f'prism:num_requests_running{{model_name="{SMOL}"}}' in text
    assert 'prism:device_pool_pages{device="cpu",state="capacity"}' in text


@pytest.fixture(scope="module")
def tiny():
    spec = ModelSpec("tiny", "dummy:tiny-llama", max_queued_requests=1)
    engine = Engine(
        EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, kv_budget_bytes=4 << 20)
    )
    s = serve_in_thread(engine, api_key="sekret", max_queued_requests=8)
    yield s
    s.close()


def test_api_key_is_required_except_for_health(tiny):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert_envelope(post(tiny.url, body, "/v1/completions"), 401, "invalid_api_key")
    assert_envelope(
        post(tiny.url, body, "/v1/completions", headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_envelope(httpx.get(tiny.url + "/v1/models"), 401)
    assert_envelope(httpx.get(tiny.url + "/metrics"), 401)
    assert httpx.get(tiny.url + "/health").status_code == 200
    ok = post(tiny.url, body, "/v1/completions", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    text = {"Content-Type": "text/plain"}
    r = httpx.post(tiny.url + "/v1/completions", content=b"x", headers=text)
    assert_envelope(r, 401)  # who asks comes first, then what was sent
    r = httpx.post(
        tiny.url + "/v1/completions",
        content=b"x",
        headers={**text, "Authorization": "Bearer sekret"},
    )
    assert_envelope(r, 415)


def test_full_queue_answers_503_with_retry_after(tiny):
    auth = {"Authorization": "Bearer sekret"}
    gate = threading.Event()
    tiny.engine.worker.send(Call(gate.wait))  # hold the engine thread: requests stay queued
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    first: dict = {}
    t = threading.Thread(
        target=lambda: first.update(r=post(tiny.url, body, "/v1/completions", headers=auth))
    )
    t.start()
    try:
        pending = 'prism:num_requests_pending{model_name="tiny"} 1.0'
        deadline = time.monotonic() + 30
        while pending not in httpx.get(tiny.url + "/metrics", headers=auth).text:
            assert time.monotonic() < deadline, "the first request was never queued"
            time.sleep(0.02)
        r = post(tiny.url, body, "/v1/completions", headers=auth)
        assert_envelope(r, 503, "server_is_overloaded")
        assert r.headers["Retry-After"] == "1"
    finally:
        gate.set()
    t.join()
    assert first["r"].status_code == 200
    wait_idle(tiny.engine, "tiny")
    tiny.engine.check_integrity()


def test_models_come_only_from_the_config(server):
    before = dict(server.engine.served)
    for name in ("/etc/passwd", "../../models/x.gguf", "dummy:llama-3.1-8b", "smollm2-135m.gguf"):
        r = post(server.url, {**CHAT, "model": name})
        assert_envelope(r, 404, "model_not_found")
    assert server.engine.served == before


def test_binds_loopback_by_default():
    from prism_server.server_args import ServerArgs, load_server_args

    assert ServerArgs().host == "127.0.0.1" and load_server_args().host == "127.0.0.1"
