"""Property-based fuzzing of every endpoint: whatever the body, never a 5xx, never a hang, the
OpenAI error envelope on 4xx, and the server still healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

MAX_LEN = 48  # small context: every accepted request finishes quickly
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def fuzz_server():
    spec = ModelSpec("tiny", "dummy:tiny-llama", block_size=4, max_model_len=MAX_LEN)
    engine = Engine(
        EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, kv_budget_bytes=2 << 20)
    )
    s = serve_in_thread(engine, max_request_bytes=64 << 10)
    yield s
    s.close()


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "bad"]) | values,
                "content": st.text(max_size=200) | values,
            }
        ),
        max_size=3,
    )
    | values
)
FIELDS = {
    "model": st.sampled_from(["tiny", "nope", "", "../../etc/passwd"]) | values,
    "messages": messages,
    "prompt": st.text(max_size=300)
    | st.lists(st.integers(-5, 600), max_size=60)
    | st.lists(st.text(max_size=20), max_size=3)
    | values,
    "max_tokens": st.integers(-3, 80) | values,
    "max_completion_tokens": st.integers(-3, 80) | values,
    "temperature": st.floats(-1, 3) | values,
    "top_p": st.floats(-0.5, 1.5) | values,
    "top_k": st.integers(-3, 600) | values,
    "n": st.integers(-1, 20) | values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | values,
    "stop_token_ids": st.lists(st.integers(-5, 10**6), max_size=5) | values,
    "logprobs": st.integers(-1, 30) | st.booleans() | values,
    "top_logprobs": st.integers(-1, 30) | values,
    "seed": st.integers(-(2**65), 2**65) | values,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | values,
    "min_tokens": st.integers(-2, 100) | values,
    "presence_penalty": st.floats(-3, 3) | values,
    "frequency_penalty": st.floats(-3, 3) | values,
    "echo": st.booleans() | values,
    "ignore_eos": st.booleans(),
    "unknown_field": values,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)
# Mostly valid requests with edge values in range: they reach the engine and stream.
EDGES = {
    "max_tokens": st.integers(1, 40),
    "temperature": st.sampled_from([0.0, 1e-6, 0.7, 2.0]),
    "top_p": st.sampled_from([1e-9, 0.1, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 10**6]),
    "n": st.integers(1, 16),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=4),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 40),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
chat_bodies = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": st.text(max_size=30),
                }
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional={**EDGES, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)},
)
completion_bodies = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "prompt": st.text(min_size=1, max_size=30)
        | st.lists(st.integers(0, 511), min_size=1, max_size=20),
    },
    optional={**EDGES, "logprobs": st.integers(0, 20), "echo": st.booleans()},
)
raw = st.binary(max_size=200) | st.text(max_size=200).map(str.encode)


def check(server, method: str, path: str, content: bytes | None) -> None:
    r = httpx.request(
        method,
        server.url + path,
        content=content,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code < 500, (path, content, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_structured_bodies(fuzz_server, body, path):
    check(fuzz_server, "POST", path, json.dumps(body).encode())


@FUZZ
@given(body=chat_bodies)
def test_valid_chat_with_edge_values(fuzz_server, body):
    check(fuzz_server, "POST", "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(body=completion_bodies)
def test_valid_completions_with_edge_values(fuzz_server, body):
    check(fuzz_server, "POST", "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(
    content=raw,
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/v1/models/tiny",
            "/health",
            "/metrics",
            "/v1/nothing",
        ]
    ),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
)
def test_raw_bytes_and_methods(fuzz_server, content, path, method):
    check(fuzz_server, method, path, content)


# Any Unicode, including what JSON can carry but UTF-8 cannot (lone surrogates), noncharacters,
# NUL, the last code point, and long strings.
wild_char = (
    st.characters()
    | st.integers(0xD800, 0xDFFF).map(chr)
    | st.sampled_from(["\uffff", "\ufffe", "\ufdd0", "\U0010ffff", "\x00", "\u200b", "\u202e"])
)
wild_text = st.lists(wild_char, max_size=40).map("".join) | st.sampled_from(
    ["x" * 5000, "\ud800" * 1000, "é" * 3000]
)
wild_chat = st.fixed_dictionaries(
    {
        "model": st.just("tiny") | wild_text,
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant"]),
                    "content": wild_text
                    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": wild_text})),
                },
                optional={"name": wild_text},
            ),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 8),
    },
    optional={
        "stop": wild_text | st.lists(wild_text, max_size=3),
        "user": wild_text,
        "stream": st.booleans(),
    },
)
wild_chat = st.tuples(wild_chat, st.dictionaries(wild_text, wild_text, max_size=2)).map(
    lambda t: {**t[1], **t[0]}  # plus unknown keys of any text
)
wild_completion = st.fixed_dictionaries(
    {
        "model": st.just("tiny") | wild_text,
        "prompt": wild_text | st.lists(wild_text, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 8),
    },
    optional={
        "stop": wild_text | st.lists(wild_text, max_size=3),
        "user": wild_text,
        "stream": st.booleans(),
        "echo": st.booleans(),
    },
)


@FUZZ
@given(body=wild_chat)
def test_any_unicode_in_chat_text_fields(fuzz_server, body):
    check(fuzz_server, "POST", "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(body=wild_completion)
def test_any_unicode_in_completion_text_fields(fuzz_server, body):
    check(fuzz_server, "POST", "/v1/completions", json.dumps(body).encode())


header_bytes = st.binary(max_size=300).filter(lambda b: not set(b) & {0, 10, 13}).map(bytes.strip)
HEADER_NAMES = [
    "X-Request-Id",
    "Authorization",
    "Content-Type",
    "Accept",
    "Accept-Encoding",
    "User-Agent",
    "Origin",
    "Cookie",
    "X-Forwarded-For",
    "Host",
]


@FUZZ
@given(
    headers=st.dictionaries(st.sampled_from(HEADER_NAMES), header_bytes, max_size=5),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics"]),
    stream=st.booleans(),
)
def test_any_header_bytes(fuzz_server, headers, path, stream):
    body = {"model": "tiny", "max_tokens": 3, "stream": stream}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    sent = {"Content-Type": "application/json", **headers}
    try:
        r = httpx.request(
            "POST" if path.startswith("/v1/c") else "GET",
            fuzz_server.url + path,
            content=json.dumps(body).encode(),
            headers=sent,
            timeout=60,
        )
    except httpx.LocalProtocolError:  # the client library refuses to send it: nothing to test
        return
    assert r.status_code < 500, (sent, r.status_code, r.text)
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif r.status_code == 200 and "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200


def test_oversized_bodies_get_413_and_long_prompts_400(fuzz_server):
    big = json.dumps({"model": "tiny", "prompt": "x" * (128 << 10)}).encode()
    r = httpx.post(fuzz_server.url + "/v1/completions", content=big, headers=JSON, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    long = {"model": "tiny", "prompt": "word " * 500, "max_tokens": 4}
    r = httpx.post(fuzz_server.url + "/v1/completions", json=long, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    fuzz_server.engine.check_integrity()
