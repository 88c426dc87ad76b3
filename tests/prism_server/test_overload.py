"""Overload and disconnects: bounded queues answer 503 at once and memory stays bounded under a
flood; clients that vanish while queued, mid-prefill or mid-decode leave nothing behind."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def srv():
    specs = (
        ModelSpec(
            "tiny",
            "dummy:tiny-llama",
            block_size=4,
            max_queued_requests=64,
            max_num_batched_tokens=8,
            max_model_len=512,
        ),
    )
    engine = Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=64 << 10, kv_budget_bytes=8 << 20)
    )
    s = serve_in_thread(engine, max_queued_requests=100)
    yield s
    s.close()


def hold_engine(s) -> threading.Event:
    gate = threading.Event()
    s.engine.worker.send(Call(gate.wait))
    return gate


def wait_until(cond, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def idle(s) -> bool:
    m = s.engine.model_snapshot("tiny", now=False)
    return m.num_requests == 0


@pytest.mark.slow
def test_a_flood_gets_503_at_once_and_memory_stays_bounded(srv):
    n, bound = 800, 64
    body = {"model": "tiny", "prompt": "flood", "max_tokens": 2}

    async def flood(gate: threading.Event | None) -> tuple[list, int]:
        conn = aiohttp.TCPConnector(limit=300)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def one():
                t = time.monotonic()
                async with session.post(srv.url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, time.monotonic() - t, r.headers.get("Retry-After")

            tasks = [asyncio.ensure_future(one()) for _ in range(n)]
            peak = rss_bytes()
            if gate is not None:  # the engine is held: all but the queue bound come back 503
                deadline = time.monotonic() + 60
                while sum(t.done() for t in tasks) < n - bound:
                    assert time.monotonic() < deadline, "refusals did not come back"
                    peak = max(peak, rss_bytes())
                    await asyncio.sleep(0.01)
                gate.set()
            return await asyncio.gather(*tasks), peak

    asyncio.run(flood(None))  # warm-up: allocator arenas, connection pools
    before = rss_bytes()
    gate = hold_engine(srv)
    try:
        results, peak = asyncio.run(flood(gate))
    finally:
        gate.set()
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) + len(busy) == n
    assert len(ok) == bound  # the per-model queue bound, exactly
    assert all(r[2] == "1" for r in busy)
    assert peak - before < 150 << 20, f"RSS grew by {(peak - before) >> 20} MiB"
    wait_until(lambda: idle(srv))
    srv.engine.check_integrity()


def _stream_then_drop(url: str, body: dict, until) -> None:
    """Opens a stream, waits for `until()` to hold, then disconnects."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        wait_until(until)


def test_disconnect_while_queued(srv):
    gate = hold_engine(srv)
    aengine_pending = 'prism:num_requests_pending{model_name="tiny"} 1.0'
    try:
        body = {"model": "tiny", "prompt": "queued", "max_tokens": 50, "stream": True}
        _stream_then_drop(
            srv.url, body, lambda: aengine_pending in httpx.get(srv.url + "/metrics").text
        )
    finally:
        gate.set()
    wait_until(lambda: idle(srv))
    assert (
        'prism:num_requests_pending{model_name="tiny"} 0.0' in httpx.get(srv.url + "/metrics").text
    )
    srv.engine.check_integrity()


def test_disconnect_mid_prefill(srv):
    m = srv.engine.worker.models["tiny"]
    prompt = list(range(10, 410))  # 400 tokens, prefilled 8 per step

    def mid_prefill() -> bool:
        reqs = list(m.requests.values())
        return bool(reqs) and 0 < reqs[0].num_computed_tokens < len(prompt)

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}
    _stream_then_drop(srv.url, body, mid_prefill)
    wait_until(lambda: idle(srv))
    assert srv.engine.model_snapshot("tiny").kv_blocks_held == 0
    srv.engine.check_integrity()


def test_disconnect_mid_decode(srv):
    m = srv.engine.worker.models["tiny"]

    def decoding() -> bool:
        reqs = list(m.requests.values())
        return bool(reqs) and reqs[0].num_output_tokens >= 3

    body = {
        "model": "tiny",
        "prompt": "decode",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    _stream_then_drop(srv.url, body, decoding)
    wait_until(lambda: idle(srv))
    assert srv.engine.model_snapshot("tiny").kv_blocks_held == 0
    srv.engine.check_integrity()


def test_the_global_queue_bound_holds_across_models():
    from prism_server.serving.frontend import Frontend
    from prism_server.serving.protocol import APIError
    from scheduler.sampling_params import SamplingParams

    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, max_queued_requests=5) for n in ("a", "b")
    )
    with Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=64 << 10, kv_budget_bytes=4 << 20)
    ) as engine:
        gate = threading.Event()
        engine.worker.send(Call(gate.wait))

        async def fill() -> tuple[int, int, int]:
            fe = Frontend(engine, max_queued_requests=8)
            params = SamplingParams(max_tokens=2)
            streams, refused = [], {"a": 0, "b": 0}
            for model, n in (("a", 7), ("b", 5)):
                for _ in range(n):
                    try:
                        streams.append(fe.submit(engine.model(model), [5, 6, 7], params))
                    except APIError as e:
                        assert e.status == 503 and e.headers["Retry-After"] == "1"
                        refused[model] += 1
            gate.set()
            for s in streams:
                async for _ in s:
                    pass
            return len(streams), refused["a"], refused["b"]

        accepted, refused_a, refused_b = asyncio.run(fill())
        assert (accepted, refused_a, refused_b) == (8, 2, 2)  # a: per-model 5; b: global 8
        engine.check_integrity()
