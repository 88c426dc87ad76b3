"""Faults: models that fail to load, and exceptions inside a model's step."""

from __future__ import annotations

import json

import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.served_model import ModelFailed
from prism_server.serving.app import serve_in_thread

PAGE = 64 << 10


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    corrupt = d / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # a header, then garbage
    specs = (
        ModelSpec("good", "dummy:tiny-llama", block_size=4),
        ModelSpec("missing", str(d / "nowhere.gguf")),
        ModelSpec("corrupt", str(corrupt)),
        # SmolLM2's 30 layers do not fit one 16-token block each into a 64 KiB page
        ModelSpec("too-big", "smollm2-135m"),
    )
    engine = Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=PAGE, kv_budget_bytes=64 * PAGE),
        strict=False,
    )
    s = serve_in_thread(engine)
    yield s
    s.close()


def test_failed_models_are_listed_with_their_error(faulty):
    data = httpx.get(faulty.url + "/v1/models").json()["data"]
    status = {m["id"]: m["status"] for m in data}
    assert status == {
        "good": "resident",
        "missing": "failed",
        "corrupt": "failed",
        "too-big": "failed",
    }
    errors = {m["id"]: m.get("error", "") for m in data}
    assert "nowhere.gguf" in errors["missing"]
    assert "corrupt.gguf" in errors["corrupt"]
    assert "cannot hold one block" in errors["too-big"]


@pytest.mark.parametrize("name", ["missing", "corrupt", "too-big"])
def test_requests_to_a_failed_model_get_a_clear_error(faulty, name):
    r = httpx.post(
        faulty.url + "/v1/completions",
        json={"model": name, "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and f"`{name}` failed to load" in err["message"]


def test_the_other_models_keep_serving(faulty):
    r = httpx.post(
        faulty.url + "/v1/completions",
        json={"model": "good", "prompt": "hi", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_strict_engine_raises_and_names_the_model(tmp_path):
    with pytest.raises(Exception, match="nowhere"):
        Engine(EngineConfig(models=(ModelSpec("m", str(tmp_path / "nowhere.gguf")),), device="cpu"))
    e = Engine(
        EngineConfig(models=(ModelSpec("m", str(tmp_path / "x.gguf")),), device="cpu"), strict=False
    )
    with pytest.raises(ModelFailed, match="`m` failed to load"):
        e.model("m")
    e.close()


def test_an_exception_in_a_step_fails_that_step_with_500_not_the_server(faulty):
    model = faulty.engine.worker.models["good"].runner.model
    original = model.forward
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    model.forward = broken_once
    try:
        body = {"model": "good", "prompt": "hi", "max_tokens": 3}
        r = httpx.post(faulty.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        calls["n"] = 0  # fail again, now after the stream's 200 went out
        with httpx.stream(
            "POST", faulty.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            lines = [x for x in s.iter_lines() if x]
        assert lines[-1] == "data: [DONE]"
        assert "injected fault" in json.loads(lines[-2][len("data: ") :])["error"]["message"]
        ok = httpx.post(faulty.url + "/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        model.forward = original
    faulty.engine.check_integrity()


def test_an_exception_outside_the_batch_fails_the_models_requests(faulty):
    sched = faulty.engine.worker.models["good"].scheduler
    original = sched.schedule

    def broken(*args):
        sched.schedule = original
        raise RuntimeError("scheduler fault")

    sched.schedule = broken
    body = {"model": "good", "prompt": "hi", "max_tokens": 3}
    r = httpx.post(faulty.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and "scheduler fault" in r.json()["error"]["message"]
    ok = httpx.post(faulty.url + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200
    faulty.engine.check_integrity()
