"""LoRA adapters through the OpenAI API: each adapter a model id in /v1/models (parent: its
base's id, root: its directory); completions and chat for an adapter id; vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter under concurrent traffic (nothing accepted is
lost: unloading waits for the adapter's requests in flight); an adapter found in lora_dirs is
loaded on its first request; bad adapters get 400 naming the problem, and nothing served is
disturbed. The pool's integrity is checked owner by owner after every test."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread
from scheduler.sampling_params import SamplingParams
from tests.models.lora_cases import Spec, make_adapters
from tests.prism_server.lora_setup import edited, make_set, tiny_base

PAGE = 64 << 10
PROMPT = [8, 8, 1, 90, 4000, 17]
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A server of the tiny base with adapter `sql` from the config, `kv` and a broken one in
    lora_dirs (max rank 16); and the bad adapters' directories."""
    root = tmp_path_factory.mktemp("lora-api")
    base, dirs, hf = make_set(root)
    bad = root / "bad"
    bad.mkdir()
    _, other = tiny_base(root / "other-base", seed=1, hidden=32)  # another model's shapes
    narrow = make_adapters(other, {"narrow": Spec(r=4)}, root / "other-made")
    narrow["narrow"].rename(bad / "wrong-shapes")
    big = make_adapters(hf, {"big": Spec(r=32, alpha=32)}, root / "big-made")
    big["big"].rename(bad / "rank-too-large")
    edited(dirs["sql"], bad / "unknown-target", {"target_modules": ["q_proj", "qkv_linear"]})
    edited(dirs["sql"], bad / "missing-weights", drop="adapter_model.safetensors")
    edited(dirs["sql"], bad / "missing-config", drop="adapter_config.json")
    resolvable = root / "resolvable"
    resolvable.mkdir()
    dirs["kv"] = edited(dirs["kv"], resolvable / "kv")
    edited(bad / "unknown-target", resolvable / "broken")
    specs = (
        ModelSpec("base", str(base), block_size=4),
        ModelSpec("sql", base="base", adapter=str(dirs["sql"])),
    )
    cfg = EngineConfig(
        models=specs,
        device="cpu",
        page_bytes=PAGE,
        kv_budget_bytes=64 * PAGE,
        max_lora_rank=16,
        lora_dirs=(str(resolvable),),
    )
    engine = Engine(cfg)
    server = serve_in_thread(engine)
    yield server, dirs, bad
    server.close()


@pytest.fixture
def server(setting):
    server = setting[0]
    yield server
    e = server.engine
    e.check_integrity()
    owned = e.pool.stats().owned
    snap = e.worker.snapshot_now().model("base")
    for a in snap.adapters:
        assert owned.get(f"{a.name}/weights", 0) == a.weight_pages
    names = {a.name for a in snap.adapters}
    for owner, pages in owned.items():  # no pages of an adapter that is not served
        if owner.endswith("/weights") and owner != "base/weights":
            assert owner.removesuffix("/weights") in names or pages == 0, owner


def tokens(engine: Engine, model: str, prompt=PROMPT) -> str:
    """The text the engine's own path gives (the tokens of the engine tests' model-level
    parity), to compare the API's with."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return engine.generate(model, [prompt], params)[0].text


def test_models_list_names_each_adapters_base(server, setting):
    dirs = setting[1]
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(dirs["sql"])
    assert cards["base"]["parent"] is None and cards["base"]["root"].endswith("base-64")
    assert cards["sql"]["status"] in ("resident", "activating", "offloaded")
    one = httpx.get(f"{server.url}/v1/models/sql").json()
    assert one["parent"] == "base"


def test_completions_and_chat_for_an_adapter(server):
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "sql"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    text = r.json()["choices"][0]["text"]
    assert text == tokens(server.engine, "sql")
    assert text != tokens(server.engine, "base")
    chat = {
        "model": "sql",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'prism:generation_tokens_total{model_name="sql"}' in metrics
    assert "prism:lora_requests_info{" in metrics
    assert 'prism:lora_adapter_resident{base="base",model_name="sql"}' in metrics


@pytest.mark.parametrize(
    "case, words",
    [
        ("wrong-shapes", "but the base's is [64 x 96] (an adapter of another model?)"),
        ("rank-too-large", "rank 32 exceeds the maximum rank 16"),
        ("unknown-target", "unknown target module 'qkv_linear'"),
        ("missing-weights", "has no adapter_model.safetensors or adapter_model.bin"),
        ("missing-config", "has no adapter_config.json"),
        ("no-such-dir", "is not a directory"),
    ],
)
def test_bad_adapters_get_400_naming_the_problem_and_disturb_nothing(server, setting, case, words):
    bad = setting[2]
    before = server.engine.pool.stats().owned
    body = {"lora_name": f"bad-{case}", "lora_path": str(bad / case)}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and f"bad-{case}" in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_adapter"
    assert server.engine.pool.stats().owned == before
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert f"bad-{case}" not in ids
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "sql"}, timeout=60)
    assert r.status_code == 200


def test_load_and_unload_bodies_are_checked(server):
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": "/x"})
    assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "base"})
    assert r.status_code == 404  # a base model is no adapter


def test_the_lora_routes_are_behind_the_api_key(setting):
    keyed = serve_in_thread(setting[0].engine, api_key="k")
    try:
        body = {"lora_name": "chat", "lora_path": str(setting[1]["chat"])}
        r = httpx.post(f"{keyed.url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 401
        r = httpx.post(f"{keyed.url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 401
    finally:
        keyed.close(close_engine=False)


async def _complete(session, url, model: str, max_tokens: int = 8) -> tuple[int, dict]:
    body = {**BODY, "model": model, "max_tokens": max_tokens}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json()


def test_runtime_load_unload_and_first_use_under_traffic_lose_nothing(server, setting):
    """Traffic to the base and `sql` throughout; `chat` loaded by the route, `kv` by its first
    requests (three at once: one load), `sql` unloaded while its requests run: every request
    accepted completes with all its tokens; `sql` is 404 after."""
    dirs, url = setting[1], server.url
    want = {m: tokens(server.engine, m) for m in ("base", "sql")}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            early = [
                asyncio.create_task(_complete(s, url, m, 24))
                for m in ("base", "sql", "sql", "base", "sql")
            ]
            await asyncio.sleep(0.05)
            body = {"lora_name": "chat", "lora_path": str(dirs["chat"])}
            async with s.post(f"{url}/v1/load_lora_adapter", json=body) as r:
                loaded = (r.status, await r.text())
            resolved = [asyncio.create_task(_complete(s, url, "kv")) for _ in range(3)]
            chat = [asyncio.create_task(_complete(s, url, "chat")) for _ in range(2)]
            async with s.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
                unloaded = (r.status, await r.text())
            after = await _complete(s, url, "sql")
            return loaded, unloaded, after, await asyncio.gather(*early, *resolved, *chat)

    loaded, unloaded, after, results = asyncio.run(main())
    assert loaded[0] == 200 and "chat" in loaded[1]
    assert unloaded[0] == 200 and "sql" in unloaded[1]
    assert after[0] == 404 and after[1]["error"]["code"] == "model_not_found"
    models = ("base", "sql", "sql", "base", "sql", "kv", "kv", "kv", "chat", "chat")
    for i, (model, (status, body)) in enumerate(zip(models, results)):
        assert status == 200, (model, body)
        assert body["usage"]["completion_tokens"] == (24 if i < 5 else 8), model
        if model in want:  # (its first 8 tokens: those of the engine's own path)
            assert body["choices"][0]["text"].startswith(want[model]), model
    assert len({b["choices"][0]["text"] for _, b in results[5:8]}) == 1  # kv's, all alike
    ids = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "sql" not in ids and ids["kv"]["parent"] == "base" and ids["chat"]["parent"] == "base"
    assert ids["kv"]["root"] == str(dirs["kv"])
    # loaded again by the route, under its old name: its tokens as before
    body = {"lora_name": "sql", "lora_path": str(dirs["sql"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "sql"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["sql"]


def test_a_bad_adapter_in_lora_dirs_gets_400_on_first_use(server):
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "broken"}, timeout=60)
    assert r.status_code == 400
    assert "unknown target module 'qkv_linear'" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "absent"}, timeout=60)
    assert r.status_code == 404


def test_an_adapter_unloaded_after_a_requests_lookup_gives_it_404(server, setting, monkeypatch):
    """The adapter goes between the request's lookup and its submission (here: unloaded as the
    engine is asked to queue it): a 404 in the error envelope, and the server serves on."""
    e, dirs = server.engine, setting[1]
    e.adapters.start_load("gone-soon", str(dirs["sql"]), "base").result(timeout=30)
    submit = e.submit

    def unload_first(served, *args, **kw):
        if served.name == "gone-soon":
            e.adapters.start_unload("gone-soon").result(timeout=30)
        return submit(served, *args, **kw)

    monkeypatch.setattr(e, "submit", unload_first)
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "gone-soon"}, timeout=60)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    monkeypatch.undo()
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "sql"}, timeout=60)
    assert r.status_code == 200


def test_an_adapter_of_lora_dirs_unloaded_after_a_requests_lookup_is_loaded_again(
    server, monkeypatch
):
    """As above, for an adapter that lora_dirs holds: the request finds it there again, as a
    request arriving then would, and is served with the adapter's tokens."""
    e = server.engine
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "kv"}, timeout=60)
    assert r.status_code == 200, r.text  # loaded from lora_dirs on first use
    want = r.json()["choices"][0]["text"]
    submit, unloads = e.submit, []

    def unload_first(served, *args, **kw):
        if served.name == "kv" and not unloads:
            unloads.append(e.adapters.start_unload("kv").result(timeout=30))
        return submit(served, *args, **kw)

    monkeypatch.setattr(e, "submit", unload_first)
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "kv"}, timeout=60)
    assert r.status_code == 200, r.text
    assert unloads and r.json()["choices"][0]["text"] == want
    assert "kv" in e.served


def test_an_adapter_past_the_host_budget_gets_503_and_the_base_serves_on(setting):
    """A host budget with no room beside the base's copy: a load gets 503 (the envelope's
    insufficient_memory), a request that finds its adapter in lora_dirs too, and nothing
    else changes."""
    import torch

    from prism_server.engine.memory_budget import weight_bytes

    dirs = setting[1]
    base = setting[0].engine.served["base"].spec
    cfg = EngineConfig(
        models=(base,),
        device="cpu",
        page_bytes=PAGE,
        kv_budget_bytes=64 * PAGE,
        host_budget_bytes=weight_bytes(base, torch.device("cpu")) + 1024,
        lora_dirs=setting[0].engine.config.lora_dirs,
    )
    server = serve_in_thread(Engine(cfg))
    try:
        body = {"lora_name": "sql", "lora_path": str(dirs["sql"])}
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and "host budget" in err["message"]
        r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "kv"}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory"
        r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "base"}, timeout=60)
        assert r.status_code == 200
        ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
        assert ids == ["base"]
        server.engine.check_integrity()
    finally:
        server.close()


def test_loads_of_one_name_at_once_join_only_when_they_load_the_same(server, setting):
    """Two loads of a name under way at once are one load if they name the same directory
    and base; another directory is refused, not told it was loaded."""
    dirs, adapters = setting[1], server.engine.adapters
    first = adapters.start_load("dup", str(dirs["chat"]))
    assert adapters.start_load("dup", str(dirs["chat"]), "base") is first
    with pytest.raises(ValueError, match="being loaded from"):
        adapters.start_load("dup", str(dirs["sql"]))
    assert first.result(timeout=60).spec.adapter == str(dirs["chat"])
    r = httpx.post(f"{server.url}/v1/completions", json={**BODY, "model": "dup"}, timeout=60)
    assert r.status_code == 200
    adapters.start_unload("dup").result(timeout=60)


def test_an_adapter_that_failed_to_load_unloads_at_once(setting, tmp_path):
    """Its own directory gone, or its base failed: nothing of it is on a device, so its unload
    answers at once, and the name can be loaded again."""
    import torch

    from prism_server.engine.memory_budget import weight_pool_bytes

    dirs = setting[1]
    base = setting[0].engine.served["base"].spec
    pinned = replace(base, pinned=True)
    specs = (
        pinned,
        ModelSpec("broken", base.source, block_size=4),  # no room beside the pinned one
        ModelSpec("gone", base="base", adapter=str(tmp_path / "nothing")),
        ModelSpec("orphan", base="broken", adapter=str(dirs["sql"])),
    )
    room = weight_pool_bytes(base, torch.device("cpu"), PAGE) + 16 * PAGE
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, pool_budget_bytes=room)
    server = serve_in_thread(Engine(cfg, strict=False))  # as the server starts: failures listed
    try:
        url = server.url
        cards = {m["id"]: m["status"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert cards["gone"] == cards["orphan"] == cards["broken"] == "failed"
        assert "the weights of pinned base" in server.engine.served["broken"].error
        for name in ("gone", "orphan"):
            r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)
            assert r.status_code == 200, r.text
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert "gone" not in ids and "orphan" not in ids
        body = {"lora_name": "orphan", "lora_path": str(dirs["sql"]), "base": "base"}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "orphan"}, timeout=60)
        assert r.status_code == 200
        server.engine.check_integrity()
    finally:
        server.close()
