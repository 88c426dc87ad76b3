"""Why a request took what it took, over HTTP: the request log's line per request that ends (its
response id, tokens, TTFT, where its time went, its preemptions), and the metrics beside it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.engine.memory_budget import weight_pool_bytes
from prism_server.serving.app import serve_in_thread
from scheduler.request import WAIT_CAUSES

PAGE = 64 << 10
PROMPTS = [list(range(5 + i, 25 + i)) for i in range(12)]
FIELDS = {
    "id",
    "model",
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "ttft_s",
    "waits",
    "preemptions",
    "recomputed_tokens",
}
BEFORE_FIRST_TOKEN = ("offloaded", "activation", "kv", "other_models", "queue", "prefill")


def tiny(name: str, seed: int) -> ModelSpec:
    return ModelSpec(name, "dummy:tiny-llama", block_size=4, seed=seed)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def logged(path: Path, rid: str, n: int = 1, timeout: float = 10) -> list[dict]:
    """The n lines of response rid, once written."""
    deadline = time.monotonic() + timeout
    while True:
        got = [x for x in lines(path) if x["id"] == rid]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def stream(url: str, body: dict) -> tuple[str, float]:
    """A streamed completion read to its end: (the id its chunks carry, its seconds)."""
    rid = None
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                rid = rid or chunk["id"]
                assert chunk["id"] == rid
    return rid, time.monotonic() - start


def samples(url: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict[str, list], name: str, **labels) -> float:
    got = [s.value for s in found.get(name, []) if labels.items() <= s.labels.items()]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def test_an_activation_is_logged_under_the_id_the_client_saw(tmp_path):
    """Two models' weights fit the pool, three are served: the request to the offloaded one
    waits for its activation, and its line says so; the waits add up to its time in the server,
    those before its first token to its TTFT. n choices get a line each; a request whose client
    goes away mid-stream gets one too, its finish reason abort."""
    specs = tuple(tiny(n, i) for i, n in enumerate("abc"))
    w = weight_pool_bytes(specs[0], torch.device("cpu"), PAGE)
    cfg = EngineConfig(
        models=specs, device="cpu", page_bytes=PAGE, pool_budget_bytes=2 * w + 7 * PAGE
    )
    path = tmp_path / "requests.jsonl"
    srv = serve_in_thread(Engine(cfg), request_log=str(path))
    try:
        assert srv.engine.model_snapshot("c").residency.value == "offloaded"
        body = {"model": "c", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        rid, took = stream(srv.url, {**body, "ignore_eos": True, "stream": True})
        assert rid.startswith("cmpl-")
        [line] = logged(path, rid)
        assert set(line) == FIELDS
        assert line["model"] == "c" and line["finish_reason"] == "length"
        assert line["prompt_tokens"] == len(PROMPTS[0]) and line["output_tokens"] == 8
        assert line["preemptions"] == 0 and line["recomputed_tokens"] == 0
        waits = line["waits"]
        assert set(waits) == set(WAIT_CAUSES) and min(waits.values()) >= 0
        moved = waits["offloaded"] + waits["activation"]  # its turn, then the copy
        assert moved > 0 and waits["prefill"] > 0 and waits["decode"] > 0
        assert srv.engine.model_snapshot("c").activations == 1
        ttft = line["ttft_s"]
        assert 0 < ttft < took
        assert sum(waits[c] for c in BEFORE_FIRST_TOKEN) == pytest.approx(ttft, abs=1e-5)
        found = samples(srv.url)
        e2e = value(found, "prism:e2e_request_latency_seconds_sum", model_name="c")
        assert sum(waits.values()) == pytest.approx(e2e, abs=max(0.05, 0.1 * e2e))
        for cause in WAIT_CAUSES:
            got = value(found, "prism:request_wait_seconds_total", model_name="c", cause=cause)
            assert got == pytest.approx(waits[cause], abs=1e-5)
        assert value(found, "prism:recomputed_tokens_total", model_name="c") == 0

        # n choices: a line each, under the response's one id
        r = httpx.post(srv.url + "/v1/completions", json={**body, "n": 2}, timeout=60)
        assert r.status_code == 200
        two = logged(path, r.json()["id"], n=2)
        assert sorted(x["index"] for x in two) == [0, 1]
        assert all(set(x) == FIELDS | {"index"} and x["model"] == "c" for x in two)
        assert all(
            x["waits"]["activation"] == x["waits"]["offloaded"] == 0 for x in two
        )  # c is resident now

        # a client that goes away mid-stream: its request is aborted, and logged
        long = {"model": "c", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json={**long, "stream": True}, timeout=60
        ) as s:
            lines_in = s.iter_lines()
            first = next(x for x in lines_in if x.startswith("data: {"))
            rid = json.loads(first[6:])["id"]
        [line] = logged(path, rid)
        assert line["finish_reason"] == "abort" and 0 < line["output_tokens"] < 400
        assert line["ttft_s"] > 0 and line["waits"]["prefill"] > 0
    finally:
        srv.close()
    srv.engine.check_integrity()
    assert len(lines(path)) == 4


def test_preempted_requests_log_their_recomputed_tokens(tmp_path):
    """Greedy admission into two pages of KV: twelve requests preempt each other; each line
    counts its preemptions and the tokens they threw away, and so do the metrics and the
    status."""
    cfg = EngineConfig(
        models=(tiny("a", 0),),
        device="cpu",
        page_bytes=PAGE,
        kv_budget_bytes=2 * PAGE,
        reserve_output_tokens=0,
    )
    path = tmp_path / "requests.jsonl"
    srv = serve_in_thread(Engine(cfg), request_log=str(path))
    try:
        body = {"model": "a", "prompt": PROMPTS, "max_tokens": 40, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        got = logged(path, r.json()["id"], n=len(PROMPTS))
        assert sorted(x["index"] for x in got) == list(range(len(PROMPTS)))
        assert all(x["finish_reason"] == "length" and x["output_tokens"] == 40 for x in got)
        hit = [x for x in got if x["preemptions"]]
        assert hit and all(x["recomputed_tokens"] > 0 and x["waits"]["preempted"] > 0 for x in hit)
        assert all(x["recomputed_tokens"] == 0 for x in got if not x["preemptions"])
        snap = srv.engine.model_snapshot("a")
        assert snap.num_preemptions == sum(x["preemptions"] for x in got)
        assert snap.recomputed_tokens == sum(x["recomputed_tokens"] for x in got)
        found = samples(srv.url)
        assert (
            value(found, "prism:recomputed_tokens_total", model_name="a") == snap.recomputed_tokens
        )
        assert value(found, "prism:num_preemptions_total", model_name="a") == snap.num_preemptions
        preempted = value(
            found, "prism:request_wait_seconds_total", model_name="a", cause="preempted"
        )
        assert preempted == pytest.approx(sum(x["waits"]["preempted"] for x in got), abs=1e-4)
        status = httpx.get(srv.url + "/v1/status").json()
        [a] = [m for d in status["devices"] for m in d["models"] if m["name"] == "a"]
        assert a["recomputed_tokens"] == snap.recomputed_tokens

    finally:
        srv.close()
    srv.engine.check_integrity()


@pytest.mark.slow  # a server process: its start-up takes a few seconds
def test_serve_takes_the_request_log_flag_and_a_client_id_names_the_line(tmp_path):
    """serve --request-log PATH: the line of a request is there once the server has stopped,
    named by the response id the client chose (X-Request-Id); an empty path is refused."""
    from prism_server.server_args import ConfigError, load_server_args
    from tests.prism_server.test_cli import prism, startup_lines, url_of

    with pytest.raises(ConfigError, match="request_log must be a file path"):
        load_server_args(None, ["m=dummy:tiny-llama"], request_log="")
    cfg = tmp_path / "prism.toml"
    cfg.write_text("port = 0\n[[models]]\nname = 'm'\nsource = 'dummy:tiny-llama'\n")
    path = tmp_path / "requests.jsonl"
    p = prism("serve", "--config", str(cfg), "--request-log", str(path))
    try:
        url = url_of(startup_lines(p))
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 3, "ignore_eos": True},
            headers={"X-Request-Id": "client-42"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["id"] == "client-42"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
    [line] = lines(path)
    assert line["id"] == "client-42" and line["model"] == "m" and line["output_tokens"] == 3
    assert set(line) == FIELDS and line["finish_reason"] == "length"
