"""The seams between the two threads and the layers: request ids are the server's own, /metrics
reads snapshots while the engine thread churns, commands are typed, snapshots are immutable."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest

from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call
from prism_server.engine.engine import Engine
from prism_server.served_model import ContextLengthExceeded, RequestRejected, ServedModel
from prism_server.serving.app import serve_in_thread
from scheduler.request import FinishReason, RequestOutput
from scheduler.snapshot import Residency

GEMMA = "gemma3-270m"
# (prompt, stop, seed): greedy, greedy with a stop string, and seeded sampling (a per-request
# random generator), the state that a shared key would mix up
PROMPTS = [
    ("The capital of France is", None, None),
    ("Once upon a time, there was", ["country"], None),
    ("The three primary colors are", None, 7),
    ("def fibonacci(n):", None, 7),
]


def completion(url: str, prompt: str, stop, seed, headers=None) -> httpx.Response:
    body = {"model": GEMMA, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    if stop:
        body["stop"] = stop
    if seed is not None:
        body.update(seed=seed, temperature=1.0)
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


@pytest.mark.slow
def test_concurrent_requests_with_the_same_request_id_do_not_share_state(server):
    """Four requests with one X-Request-Id, held until all four are queued so they run in one
    batch: each answer equals its request run alone (with the header as the key, their tokens
    came back interleaved and seeded ones drew from one generator)."""
    alone = [completion(server.url, *p).json()["choices"][0]["text"] for p in PROMPTS]
    results: dict[int, httpx.Response] = {}
    gate = threading.Event()
    server.engine.worker.send(Call(gate.wait))  # hold the engine thread
    threads = [
        threading.Thread(
            target=lambda i=i: results.update(
                {i: completion(server.url, *PROMPTS[i], headers={"X-Request-Id": "same3"})}
            )
        )
        for i in range(len(PROMPTS))
    ]
    try:
        for t in threads:
            t.start()
        pending = f'prism:num_requests_pending{{model_name="{GEMMA}"}} {len(PROMPTS)}.0'
        deadline = time.monotonic() + 60
        while pending not in httpx.get(server.url + "/metrics").text:
            assert time.monotonic() < deadline, "the requests were never all queued"
            time.sleep(0.02)
    finally:
        gate.set()
    for t in threads:
        t.join()
    for i, r in sorted(results.items()):
        assert r.status_code == 200
        assert r.headers["X-Request-Id"] == "same3"
        assert r.json()["id"] == "same3"  # echoed, never used as a key
        assert r.json()["choices"][0]["text"] == alone[i], (i, PROMPTS[i])
    server.engine.check_integrity()


@pytest.fixture(scope="module")
def two_tiny():
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i, max_cached_pages=0)
        for i, n in enumerate(("a", "b"))
    )
    engine = Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=64 << 10, kv_budget_bytes=4 << 20)
    )
    s = serve_in_thread(engine, max_queued_requests=512)
    yield s
    s.close()


def test_metrics_scrapes_never_fail_while_requests_churn(two_tiny):
    """Short requests to two models map and unmap pages all the time (no cached reserve) while
    /metrics is scraped in a tight loop: every scrape is a 200 with the page gauges."""
    stop = threading.Event()
    scrapes: list[int] = []

    def scrape() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.get(two_tiny.url + "/metrics")
                scrapes.append(r.status_code)
                assert "prism:model_kv_pages" in r.text

    async def churn() -> list[int]:
        import aiohttp

        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {
                    "model": "ab"[i % 2],
                    "prompt": list(range(5, 5 + 3 + i % 40)),
                    "max_tokens": 1 + i % 5,
                    "ignore_eos": True,
                }
                async with session.post(two_tiny.url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status

            statuses = []
            for wave in range(6):
                statuses += await asyncio.gather(*(one(wave * 40 + i) for i in range(40)))
            return statuses

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for t in scrapers:
        t.start()
    try:
        statuses = asyncio.run(churn())
    finally:
        stop.set()
        for t in scrapers:
            t.join()
    assert statuses == [200] * len(statuses)
    assert len(scrapes) > 20 and set(scrapes) == {200}
    two_tiny.engine.check_integrity()


def test_snapshots_are_immutable_published_state(two_tiny):
    e = two_tiny.engine
    snap = e.worker.snapshot_now()
    assert [m.name for m in snap.models] == ["a", "b"]
    a = snap.model("a")
    assert a.residency is Residency.RESIDENT and a.num_requests == 0
    assert a.kv_blocks_held == 0 and a.kv_blocks_capacity > 0 and a.weight_bytes > 0
    assert snap.pool.owned == sum(m.kv_pages + m.weight_pages for m in snap.models)
    assert all(m.weight_pages > 0 for m in snap.models)
    assert snap.pool.created == snap.pool.free + snap.pool.owned
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_running = 3
    later = e.worker.snapshot_now()
    assert later.seq > snap.seq and later is not snap


def test_a_held_engine_shows_queued_work_in_its_snapshot(two_tiny):
    e = two_tiny.engine
    gate = threading.Event()
    e.worker.send(Call(gate.wait))
    try:
        r = {}
        t = threading.Thread(
            target=lambda: r.update(
                x=httpx.post(
                    two_tiny.url + "/v1/completions",
                    json={"model": "a", "prompt": [5, 6, 7], "max_tokens": 2},
                    timeout=60,
                )
            )
        )
        t.start()
        time.sleep(0.3)
        assert e.model_snapshot("a", now=False).num_requests == 0  # not handed over yet
    finally:
        gate.set()
    t.join()
    assert r["x"].status_code == 200
    assert e.model_snapshot("a").num_requests == 0


def test_calls_return_results_and_raise_errors_on_the_caller(two_tiny):
    w = two_tiny.engine.worker
    assert w.call(lambda: threading.current_thread().name) == f"prism-engine-{w.device}"

    def boom():
        raise KeyError("inside the engine thread")

    with pytest.raises(KeyError, match="inside the engine thread"):
        w.call(boom)
    with pytest.raises(TypeError, match="not a command"):
        w.call(lambda: w._handle("submit"))


def test_internal_ids_are_unique_and_the_servers_own(two_tiny):
    e = two_tiny.engine
    served = e.model("a")
    ids = {e.add_request("a", [5, 6], _params()).request_id for _ in range(20)}
    assert len(ids) == 20
    assert all(i.startswith("r") for i in ids)
    deadline = time.monotonic() + 30
    while e.model_snapshot("a", now=False).num_requests:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert served.name == "a"
    e.check_integrity()


def _params():
    from scheduler.sampling_params import SamplingParams

    return SamplingParams(max_tokens=2, ignore_eos=True)


# ---- the frontend handle and the accumulator, as plain objects ---------------------------------
def served(max_model_len=64, max_kv_tokens=48) -> ServedModel:
    return ServedModel(
        ModelSpec("m", "dummy:tiny-llama"),
        max_model_len=max_model_len,
        max_kv_tokens=max_kv_tokens,
        vocab_size=100,
    )


def test_one_length_check_gives_the_room_and_names_the_field():
    s = served()
    assert s.check(10, 5) == 5
    assert served(max_kv_tokens=64).check(10, None) == 54  # as many as the context allows
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 64") as e:
        s.check(60, 10)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(ContextLengthExceeded, match="60 in the messages") as e:
        s.check(60, 10, ("messages", "max_completion_tokens"))
    assert e.value.param == "messages"
    with pytest.raises(ContextLengthExceeded) as e:
        s.check(10, 100, ("messages", "max_completion_tokens"))
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(ContextLengthExceeded, match="KV cache"):
        s.check(40, 20)  # within the context, beyond what the KV can hold
    with pytest.raises(RequestRejected, match="prompt is empty"):
        s.check(0, 1)
    with pytest.raises(RequestRejected, match="Token ids"):
        s.encode([5, 100])


def test_the_completion_accumulates_deltas():
    c = Completion([1, 2], arrival_time=10.0)

    def out(ids, text, finished=False):
        reason = FinishReason.LENGTH if finished else None
        return RequestOutput("r0", ids, text, None, finished, reason, 2, len(c.token_ids) + 1)

    c.add(out([], ""), 10.5)  # a delta without tokens (held-back text)
    assert c.first_token_time is None
    c.add(out([7], "a"), 11.0)
    c.add(out([8], "b", finished=True), 12.0)
    assert (c.token_ids, c.text, c.first_token_time, c.finish_time) == ([7, 8], "ab", 11.0, 12.0)
    assert c.finished and c.finish_reason is FinishReason.LENGTH
