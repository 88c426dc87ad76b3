"""Weights in the balloon: models that do not all fit share the pool in time. Idle ones are
evicted (unmapped: the host copy is the truth), a request brings its model back, admin calls move
models now, and every accepted request completes with the tokens of an all-resident run."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from dataclasses import replace

import aiohttp
import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call, TransitionRefused
from prism_server.engine.engine import Engine
from prism_server.engine.memory_budget import weight_pool_bytes
from prism_server.served_model import ContextLengthExceeded
from prism_server.serving.app import serve_in_thread
from scheduler.sampling_params import SamplingParams
from scheduler.snapshot import Residency

PAGE = 64 << 10
CPU = "cpu"
NAMES = ("a", "b", "c", "d")


def specs(pinned: str | None = None) -> tuple[ModelSpec, ...]:
    return tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i, pinned=n == pinned)
        for i, n in enumerate(NAMES)
    )


def two_at_a_time(pinned: str | None = None) -> EngineConfig:
    """A pool with the weights of two of the four models (9 pages each) and 6 pages of KV."""
    s = specs(pinned)
    w = weight_pool_bytes(s[0], __import__("torch").device(CPU), PAGE)
    return EngineConfig(models=s, device=CPU, page_bytes=PAGE, pool_budget_bytes=2 * w + 7 * PAGE)


def states(e: Engine) -> dict[str, str]:
    snap = e.worker.snapshot_now()
    return {m.name: m.residency.value for m in snap.models}


PROMPTS = [list(range(5 + i, 25 + i)) for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """Every model resident (a KV budget beside all weights): the tokens to match."""
    cfg = EngineConfig(models=specs(), device=CPU, page_bytes=PAGE, kv_budget_bytes=64 * PAGE)
    with Engine(cfg) as e:
        assert set(states(e).values()) == {"resident"}
        out = {n: [c.token_ids for c in e.generate(n, PROMPTS, GREEDY)] for n in NAMES}
        e.check_integrity()
    return out


def test_models_load_in_config_order_while_they_fit():
    with Engine(two_at_a_time()) as e:
        assert states(e) == {"a": "resident", "b": "resident", "c": "offloaded", "d": "offloaded"}
        snap = e.worker.snapshot_now()
        by = {m.name: m for m in snap.models}
        assert by["c"].weight_pages == 0 and by["a"].weight_pages > 0
        assert snap.pool.owned == sum(m.weight_pages + m.kv_pages for m in snap.models)
        e.check_integrity()


def test_a_pinned_models_weights_are_out_of_the_others_reach():
    """The pages a pinned model's weights hold never come back: a request longer than what
    the rest of the pool holds is refused when it comes, one that fits it runs to the end."""
    with Engine(two_at_a_time(pinned="a")) as e:
        reach = {n: e.model(n).max_kv_tokens for n in NAMES}
        assert reach["b"] == reach["c"] < reach["a"]  # a: the pool but its own weights
        prompt = list(range(5, 25))
        fits = SamplingParams(max_tokens=reach["c"] - len(prompt), temperature=0, ignore_eos=True)
        with pytest.raises(ContextLengthExceeded):
            e.generate("c", [prompt], replace(fits, max_tokens=fits.max_tokens + 1))
        (done,) = e.generate("c", [prompt], fits)
        assert len(done.token_ids) == fits.max_tokens and states(e)["a"] == "resident"
        e.check_integrity()


def test_a_request_activates_its_model_and_lru_idle_models_make_room(reference):
    with Engine(two_at_a_time()) as e:
        for n in ("c", "a", "d", "b", "c"):  # each one evicts the least recently used idle
            got = [c.token_ids for c in e.generate(n, PROMPTS, GREEDY)]
            assert got == reference[n], n
            assert states(e)[n] == "resident"
            e.check_integrity()
        snap = {m.name: m for m in e.worker.snapshot_now().models}
        assert sum(m.activations for m in snap.values()) >= 4
        assert sum(m.evictions for m in snap.values()) >= 4
        assert snap["c"].bytes_activated > 0 and snap["c"].last_activation_s is not None


def test_concurrent_traffic_to_all_models_gets_all_resident_answers(reference):
    with Engine(two_at_a_time()) as e:
        done = {}

        def run(n: str) -> None:
            done[n] = [c.token_ids for c in e.generate(n, PROMPTS, GREEDY)]

        for _ in range(2):
            threads = [threading.Thread(target=run, args=(n,)) for n in NAMES]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert done == reference
        snap = e.worker.snapshot_now()
        assert sum(m.evictions for m in snap.models) >= 2
        e.check_integrity()


def test_admin_transitions_and_what_they_refuse(reference):
    with Engine(two_at_a_time(pinned="a")) as e:
        assert states(e)["a"] == "resident"
        with pytest.raises(TransitionRefused, match="pinned"):
            e.evict("a")
        assert e.activate("d") >= 0 and states(e)["d"] == "resident"  # b (idle) made room
        assert states(e)["b"] == "offloaded"
        assert e.evict("d") >= 0 and states(e)["d"] == "offloaded"
        assert [c.token_ids for c in e.generate("d", PROMPTS, GREEDY)] == reference["d"]
        e.check_integrity()


@pytest.mark.slow
def test_an_admin_evict_under_load_loses_nothing(reference, steps_ahead):
    with Engine(two_at_a_time()) as e:
        results: dict[int, list[int]] = {}
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        want = e.generate("a", PROMPTS[:3], long)  # resident, no eviction: the reference
        q: queue.SimpleQueue = queue.SimpleQueue()
        for i, p in enumerate(PROMPTS[:3]):
            toks: list[int] = []

            def sink(out, toks=toks, i=i):
                toks.extend(out.new_token_ids)
                if out.finished:
                    results[i] = toks
                    q.put(out.finish_reason)

            e.add_request("a", p, long, sink)
        deadline = time.monotonic() + 60
        while not any(m.num_running for m in e.worker.snapshot_now().models):
            assert time.monotonic() < deadline
        e.evict("a", drain_s=0)  # mid-decode: preempted back to the queue, then it comes back
        for _ in range(3):
            assert q.get(timeout=120).value == "length"
        assert [results[i] for i in range(3)] == [w.token_ids for w in want]
        snap = e.model_snapshot("a")
        assert snap.evictions >= 1 and snap.activations >= 1 and snap.num_preemptions >= 1
        e.check_integrity()


def _stream_into(e: Engine, model: str, prompts, params) -> tuple[dict, queue.SimpleQueue]:
    """Queues each prompt; returns {i: tokens} filled as they finish, and a queue of reasons."""
    results: dict[int, list[int]] = {}
    q: queue.SimpleQueue = queue.SimpleQueue()
    for i, p in enumerate(prompts):
        toks: list[int] = []

        def sink(out, toks=toks, i=i):
            toks.extend(out.new_token_ids)
            if out.finished:
                results[i] = toks
                q.put(out.finish_reason.value)

        e.add_request(model, p, params, sink)
    return results, q


def _until(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_a_drain_lets_running_requests_finish_and_queues_new_ones(reference):
    """evict with a drain: running requests finish (none preempted), a request arriving while
    the model drains waits in the queue and brings the model back once it is offloaded."""
    with Engine(two_at_a_time()) as e:
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        want = [c.token_ids for c in e.generate("a", PROMPTS[:2], long)]
        before = e.model_snapshot("a")
        results, q = _stream_into(e, "a", PROMPTS[:2], long)
        _until(lambda: e.model_snapshot("a").num_running == 2, "never ran")
        evicted = {}
        t = threading.Thread(target=lambda: evicted.update(s=e.evict("a", drain_s=120)))
        t.start()
        _until(lambda: states(e)["a"] == "draining", "never drained")
        late, late_q = _stream_into(e, "a", PROMPTS[2:3], GREEDY)  # arrives while it drains
        snap = e.model_snapshot("a")
        assert snap.residency is Residency.DRAINING and snap.num_waiting == 1
        t.join(timeout=120)
        assert evicted["s"] > 0 and q.get(timeout=1) == q.get(timeout=1) == "length"
        assert [results[i] for i in range(2)] == want
        assert late_q.get(timeout=120) == "length" and late[0] == reference["a"][2]
        snap = e.model_snapshot("a")
        assert snap.num_preemptions == 0
        assert snap.evictions == before.evictions + 1
        assert snap.activations == before.activations + 1
        assert snap.last_eviction_s is not None and snap.last_eviction_s > 0
        e.check_integrity()


def test_a_drain_past_its_time_requeues_the_rest(reference):
    with Engine(two_at_a_time()) as e:
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        results, q = _stream_into(e, "a", PROMPTS[:2], long)
        _until(lambda: e.model_snapshot("a").num_running == 2, "never ran")
        assert e.evict("a", drain_s=0.05) < 30
        assert e.model_snapshot("a").num_preemptions >= 1
        assert q.get(timeout=120) == q.get(timeout=120) == "length"
        again = [c.token_ids for c in e.generate("a", PROMPTS[:2], long)]
        assert [results[i] for i in range(2)] == again
        e.check_integrity()


@pytest.fixture()
def hold_copies(monkeypatch):
    """hold() makes later activation copies wait for the gate it returns (then run for real)."""
    import kvpool.host_copy

    gate, real = threading.Event(), kvpool.host_copy.copy_chunks

    def held(dst, src, chunk_bytes):
        assert gate.wait(120)
        real(dst, src, chunk_bytes)

    def hold() -> threading.Event:
        monkeypatch.setattr(kvpool.host_copy, "copy_chunks", held)
        return gate

    yield hold
    gate.set()


def test_requests_arriving_while_a_model_activates_share_it_and_others_keep_serving(
    reference, hold_copies
):
    with Engine(two_at_a_time()) as e:
        gate = hold_copies()
        first, q1 = _stream_into(e, "c", PROMPTS[:3], GREEDY)
        _until(lambda: states(e)["c"] == "activating", "never activated")
        second, q2 = _stream_into(e, "c", PROMPTS[3:], GREEDY)  # arrives mid-activation
        # the resident model keeps serving while c's copy is in flight (the other made room)
        (other,) = (n for n, st in states(e).items() if st == "resident")
        assert [x.token_ids for x in e.generate(other, PROMPTS, GREEDY)] == reference[other]
        assert states(e)["c"] == "activating" and e.model_snapshot("c").num_waiting == 6
        gate.set()
        for _ in range(3):
            assert q1.get(timeout=120) == q2.get(timeout=120) == "length"
        assert [first[i] for i in range(3)] + [second[i] for i in range(3)] == reference["c"]
        snap = e.model_snapshot("c")
        assert snap.activations == 1 and snap.residency is Residency.RESIDENT
        assert sum(snap.activation_buckets) == 1
        e.check_integrity()


def test_a_failed_copy_leaves_the_model_offloaded_and_the_next_request_retries(
    reference, monkeypatch
):
    import kvpool.host_copy

    real, calls = kvpool.host_copy.copy_chunks, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("copy failed")
        real(*args)

    with Engine(two_at_a_time()) as e:
        monkeypatch.setattr(kvpool.host_copy, "copy_chunks", flaky)
        with pytest.raises(OSError, match="copy failed"):
            e.activate("c")
        assert states(e)["c"] == "offloaded"
        e.check_integrity()
        assert [x.token_ids for x in e.generate("c", PROMPTS, GREEDY)] == reference["c"]
        assert e.model_snapshot("c").activations == 1
        e.check_integrity()


# ---- over HTTP -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    s = serve_in_thread(Engine(two_at_a_time(pinned="a")))
    yield s
    s.close()


def test_models_list_their_state_and_admin_routes_move_them(srv):
    def listed() -> dict[str, str]:
        return {m["id"]: m["status"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}

    assert listed() == {"a": "resident", "b": "resident", "c": "offloaded", "d": "offloaded"}
    r = httpx.post(srv.url + "/v1/models/c/activate", json={}, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "resident" and r.json()["seconds"] >= 0
    assert listed()["c"] == "resident" and listed()["b"] == "offloaded"
    r = httpx.post(srv.url + "/v1/models/a/evict", json={}, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "transition_refused"
    r = httpx.post(srv.url + "/v1/models/nope/evict", json={}, timeout=60)
    assert r.status_code == 404
    r = httpx.post(srv.url + "/v1/models/c/evict", timeout=60)  # no JSON: a cross-site form
    assert r.status_code == 415
    r = httpx.post(srv.url + "/v1/models/c/evict", json={}, timeout=60)
    assert r.status_code == 200 and listed()["c"] == "offloaded"
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'prism:model_state{model_name="c",state="offloaded"} 1.0' in metrics
    assert 'prism:model_activations_total{model_name="c"} 1.0' in metrics
    assert 'prism:model_activation_seconds_count{model_name="c"} 1.0' in metrics
    assert 'prism:model_activation_seconds_bucket{le="+Inf",model_name="c"} 1.0' in metrics
    for state in ("activating", "draining"):
        assert f'prism:model_state{{model_name="c",state="{state}"}} 0.0' in metrics
    assert 'prism:model_memory_bytes{kind="overhead",model_name="c"} 0.0' in metrics  # CPU
    assert 'prism:model_state_since_seconds{model_name="c"}' in metrics
    # evicted once after its load (no room at start-up), once now
    assert 'prism:model_evictions_total{model_name="c"} 2.0' in metrics
    # the control plane's view: policy, latency model, deadlines, page moves
    dev = srv.engine.snapshots()[0].device
    assert f'prism:policy_info{{device="{dev}",policy="prism"}} 1.0' in metrics
    assert 'prism:latency_estimate_seconds{model_name="c",shape="prefill_1k"}' in metrics
    assert 'prism:num_requests_deferred{model_name="c"} 0.0' in metrics
    assert 'prism:request_deadlines_total{model_name="c",outcome="met",slo="ttft"}' in metrics
    assert f'prism:page_moves_pages_total{{device="{dev}",giver="c",reason="admin"' in metrics
    assert listed_policy(srv) == {"prism"}
    srv.engine.check_integrity()


def listed_policy(srv) -> set[str]:
    return {m["policy"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}


def test_streams_to_every_model_at_once_all_finish(srv):
    async def one(session, model: str, i: int) -> tuple[int, str]:
        body = {
            "model": model,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        async with session.post(srv.url + "/v1/completions", json=body) as r:
            return r.status, await r.text()

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, NAMES[i % 4], i) for i in range(24)))

    results = asyncio.run(main())
    assert [s for s, _ in results] == [200] * 24
    for i, (_, text) in enumerate(results):
        if i % 2 == 0:
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
    states_now = {m.name: m.residency for m in srv.engine.worker.snapshot_now().models}
    assert states_now["a"] is Residency.RESIDENT  # pinned
    srv.engine.check_integrity()


def test_keep_alive_evicts_an_idle_model_without_pressure(reference):
    s = tuple(
        ModelSpec(
            n, "dummy:tiny-llama", block_size=4, seed=i, keep_alive_s=0.3 if n == "b" else None
        )
        for i, n in enumerate(("a", "b"))
    )
    cfg = EngineConfig(models=s, device=CPU, page_bytes=PAGE, kv_budget_bytes=16 * PAGE)
    with Engine(cfg) as e:
        assert [c.token_ids for c in e.generate("b", PROMPTS, GREEDY)] == reference["b"]
        deadline = time.monotonic() + 10
        while states(e)["b"] != "offloaded":
            assert time.monotonic() < deadline, "b was never evicted"
            time.sleep(0.05)
        assert states(e)["a"] == "resident"  # no keep-alive: stays
        assert [c.token_ids for c in e.generate("b", PROMPTS, GREEDY)] == reference["b"]
        e.check_integrity()


def test_the_host_budget_is_checked_at_start_up():
    with pytest.raises(ValueError, match=r"host_budget_bytes allows .* \(a 0.00 GiB, b"):
        Engine(
            EngineConfig(
                models=specs()[:2], device=CPU, page_bytes=PAGE, host_budget_bytes=100 << 10
            )
        )


@pytest.fixture()
def crowded():
    """One model fits at a time; b waits at most 2.5 s to be made ready."""
    s = (
        ModelSpec("a", "dummy:tiny-llama", block_size=4, seed=0),
        ModelSpec("b", "dummy:tiny-llama", block_size=4, seed=1, max_wait_s=2.5),
    )
    w = weight_pool_bytes(s[0], __import__("torch").device(CPU), PAGE)
    cfg = EngineConfig(models=s, device=CPU, page_bytes=PAGE, pool_budget_bytes=w + 7 * PAGE)
    srv = serve_in_thread(Engine(cfg))
    yield srv
    srv.close()


@pytest.mark.slow
def test_a_waiting_stream_gets_keep_alives_then_503_past_max_wait(crowded):
    assert states(crowded.engine) == {"a": "resident", "b": "offloaded"}
    gate = threading.Event()
    crowded.engine.worker.send(Call(gate.wait))  # the device is busy: b cannot be made ready
    body = {"model": "b", "prompt": [5, 6], "max_tokens": 2, "stream": True}
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", crowded.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x]
        took = time.monotonic() - t0
        assert lines.count(": loading") >= 2 and 2.4 < took < 5, (lines, took)
        assert json.loads(lines[-2][6:])["error"]["code"] == "server_is_overloaded"
        assert lines[-1] == "data: [DONE]"
        r = httpx.post(crowded.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "server_is_overloaded"
    finally:
        gate.set()
    r = httpx.post(crowded.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200  # the device is free: b activates, evicting idle a
    assert states(crowded.engine) == {"a": "offloaded", "b": "resident"}
    deadline = time.monotonic() + 10  # the abandoned requests were aborted: nothing waits
    while crowded.engine.model_snapshot("b", now=False).num_requests:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    crowded.engine.check_integrity()


def test_shutdown_during_an_activation_finishes_the_streams_waiting_for_it(hold_copies):
    """SIGTERM's path (the server's stop event) while a model's copy is in flight: the server
    drains, the activation lands, the waiting stream gets all its tokens and [DONE]."""
    srv = serve_in_thread(Engine(two_at_a_time()))
    try:
        gate = hold_copies()
        body = {
            "model": "c",
            "prompt": PROMPTS[0],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines: list[str] = []

        def client() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                lines.extend(x for x in r.iter_lines() if x)

        t = threading.Thread(target=client)
        t.start()
        _until(lambda: states(srv.engine)["c"] == "activating", "never activated")
        closer = threading.Thread(target=srv.close, kwargs={"close_engine": False})
        closer.start()
        _until(lambda: httpx.get(srv.url + "/health").status_code == 503, "never drained")
        gate.set()
        t.join(120)
        closer.join(120)
        assert not t.is_alive() and not closer.is_alive()
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and not any("error" in ev for ev in events)
        assert [c["finish_reason"] for ev in events for c in ev["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 12
        srv.engine.check_integrity()
    finally:
        srv.engine.close()


# ---- admin transitions under traffic -------------------------------------------------------------
def _roomy(drain_s: float = 5.0) -> EngineConfig:
    """a and b both resident with KV room for long streams; b drains for up to drain_s."""
    s = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i, drain_timeout_s=drain_s)
        for i, n in enumerate(("a", "b"))
    )
    return EngineConfig(models=s, device=CPU, page_bytes=PAGE, kv_budget_bytes=96 * PAGE)


def test_an_evict_interrupted_by_an_activate_answers_409_at_once():
    """evict b while a long stream runs (it drains), then activate it while it drains: the
    activate answers, and so does the evict (409 in the error envelope), not at b's next
    eviction; the stream finishes on the resident model."""
    srv = serve_in_thread(Engine(_roomy(drain_s=120)))
    try:
        e = srv.engine
        long = SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True)
        results, q = _stream_into(e, "b", PROMPTS[:1], long)
        _until(lambda: e.model_snapshot("b").num_running == 1, "never ran")
        evicted: dict = {}

        def evict() -> None:
            r = httpx.post(srv.url + "/v1/models/b/evict", json={}, timeout=60)
            evicted.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=evict)
        t.start()
        _until(lambda: states(e)["b"] == "draining", "never drained")
        r = httpx.post(srv.url + "/v1/models/b/activate", json={}, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "resident"
        t.join(timeout=10)
        assert not t.is_alive(), "the evict never answered"
        assert evicted["status"] == 409, evicted
        error = evicted["body"]["error"]
        assert (
            error["code"] == "transition_refused" and "activated while draining" in error["message"]
        )
        assert states(e)["b"] == "resident" and e.model_snapshot("b").num_running == 1
        assert q.get(timeout=120) == "length" and len(results[0]) == 1900
        assert e.model_snapshot("b").evictions == 0
        e.check_integrity()
    finally:
        srv.close()


def test_pending_admin_moves_hold_no_thread_that_tokenizing_needs():
    """Transitions are awaited on the event loop: with the device busy, many evicts wait for it
    and a /tokenize call (tokenized off the loop) still answers at once; then every evict
    answers."""
    srv = serve_in_thread(Engine(_roomy()))
    gate = threading.Event()
    try:
        srv.engine.worker.send(Call(gate.wait))  # the device is busy: no transition can end
        n = 40  # more than the default executor's threads on any machine (at most 32)
        answers: list[int] = []

        async def evicts() -> None:
            async with aiohttp.ClientSession() as session:

                async def one() -> None:
                    async with session.post(srv.url + "/v1/models/b/evict", json={}) as r:
                        answers.append(r.status)

                await asyncio.gather(*(one() for _ in range(n)))

        t = threading.Thread(target=lambda: asyncio.run(evicts()))
        t.start()
        time.sleep(1.0)  # every evict has reached the server
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/tokenize", json={"model": "a", "prompt": "hello"}, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["count"] > 0
        assert took < 5, f"tokenizing waited {took:.1f} s behind the pending evicts"
        assert not answers  # they still wait for the device
        gate.set()
        t.join(timeout=60)
        assert answers == [200] * n
        assert states(srv.engine)["b"] == "offloaded"
        srv.engine.check_integrity()
    finally:
        gate.set()
        srv.close()


def test_an_idle_model_reports_no_deferred_requests():
    """A TTFT SLO no request can meet: the arbitrator defers the request (it still runs, late);
    once it is done and nothing waits, the snapshot (and /metrics) says 0 deferred."""
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4, ttft_slo_ms=1e-6)
    cfg = EngineConfig(models=(spec,), device=CPU, page_bytes=PAGE, kv_budget_bytes=16 * PAGE)
    with Engine(cfg) as e:
        (c,) = e.generate("a", PROMPTS[:1], GREEDY)
        assert len(c.token_ids) == 12
        snap = e.model_snapshot("a")
        assert snap.num_waiting == snap.num_running == 0
        assert {k: missed for k, _, missed in snap.slo_met}["ttft"] == 1  # it was late
        assert snap.num_deferred == 0
        e.check_integrity()


def test_a_transition_answers_once_the_published_state_shows_it(monkeypatch):
    """A busy device publishes its snapshot every _PUBLISH_S at most (here: never on its own);
    still, once an evict or an activate has answered, the published snapshot (what /v1/models
    and /v1/status read) shows the state it reached."""
    from prism_server.engine import device_worker

    with Engine(_roomy()) as e:
        long = SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True)
        _, q = _stream_into(e, "a", PROMPTS[:1], long)  # keeps the device stepping
        _until(lambda: e.model_snapshot("a").num_running == 1, "never ran")
        monkeypatch.setattr(device_worker, "_PUBLISH_S", 3600.0)

        def published(name: str) -> str:
            return next(m for m in e.snapshots()[0].models if m.name == name).residency.value

        e.evict("b")
        assert published("b") == "offloaded"
        e.activate("b")
        assert published("b") == "resident"
        assert e.model_snapshot("a").num_running == 1  # (the device was busy all along)
        monkeypatch.setattr(device_worker, "_PUBLISH_S", 0.005)
        assert q.get(timeout=120) == "length"
        e.check_integrity()
