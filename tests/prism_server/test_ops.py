"""Operating the server: CORS for browser clients (off unless origins are configured; a
preflight answered without the API key), an access line per request (text or JSON), and
progress bars that stay quiet when stderr is not a terminal."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx
import pytest

from prism_server import logs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread

ORIGIN = "http://localhost:3000"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(models=(ModelSpec("tiny", "dummy:tiny-llama"),), device="cpu"))
    yield e
    e.close()


def preflight(url: str) -> httpx.Response:
    return httpx.options(
        url + "/v1/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_cors_is_off_by_default(engine):
    s = serve_in_thread(engine)
    try:
        assert preflight(s.url).status_code in (403, 405)
        r = httpx.post(s.url + "/v1/completions", json=BODY, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        s.close(close_engine=False)


def test_configured_origins_get_preflights_and_headers_even_with_an_api_key(engine):
    s = serve_in_thread(engine, cors_origins=(ORIGIN,), api_key="k")
    try:
        r = preflight(s.url)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        auth = {"Origin": ORIGIN, "Authorization": "Bearer k"}
        r = httpx.post(s.url + "/v1/completions", json=BODY, headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.post(s.url + "/v1/completions", json=BODY, headers={"Origin": ORIGIN})
        assert r.status_code == 401  # the key is still needed for the call itself
        other = {"Origin": "http://evil.example", "Authorization": "Bearer k"}
        r = httpx.post(s.url + "/v1/completions", json=BODY, headers=other)
        assert "access-control-allow-origin" not in r.headers
    finally:
        s.close(close_engine=False)


def test_an_access_line_per_request_with_model_and_tokens(engine, caplog):
    s = serve_in_thread(engine)
    try:
        with caplog.at_level(logging.INFO, logger="prism.access"):
            httpx.post(s.url + "/v1/completions", json=BODY)
            httpx.post(s.url + "/v1/completions", json={**BODY, "stream": True})
            httpx.get(s.url + "/v1/models")
            httpx.post(s.url + "/v1/completions", json={**BODY, "model": "nope"})
        lines = [r for r in caplog.records if r.name == "prism.access"]
        assert [(r.method, r.path, r.status) for r in lines] == [
            ("POST", "/v1/completions", 200),
            ("POST", "/v1/completions", 200),
            ("GET", "/v1/models", 200),
            ("POST", "/v1/completions", 404),
        ]
        assert lines[0].model == "tiny" and lines[0].completion_tokens == 3
        assert lines[1].prompt_tokens == lines[0].prompt_tokens > 0
        assert "model=tiny" in lines[0].getMessage() and lines[0].seconds > 0
        formatted = json.loads(logs.JSONFormatter().format(lines[0]))
        assert formatted["status"] == 200 and formatted["model"] == "tiny"
        assert formatted["logger"] == "prism.access" and formatted["level"] == "info"
    finally:
        s.close(close_engine=False)
    s = serve_in_thread(engine, access_log=False)
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="prism.access"):
            httpx.post(s.url + "/v1/completions", json=BODY)
        assert not [r for r in caplog.records if r.name == "prism.access"]
    finally:
        s.close(close_engine=False)


@pytest.mark.slow
def test_json_logs_and_quiet_progress_bars_when_not_a_terminal():
    code = (
        "from prism_server import logs; import logging; logs.configure('json');"
        "logging.getLogger('x').info('hello %s', 'there', extra={'model': 'm'});"
        "from models.loader import load_model; from prism_server import envs;"
        "load_model('smollm2-135m', cache_root=envs.gguf_cache_dir())"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stderr.splitlines()[0])
    assert first["message"] == "hello there" and first["model"] == "m"
    assert "loading" not in r.stderr and "\r" not in r.stderr  # no bar in a pipe
