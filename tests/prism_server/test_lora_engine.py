"""LoRA adapters served by the engine: adapters of a tiny real base (made with peft) named in the
config, their requests run in their base's steps, each with the tokens the model-level path gives
it alone (that path is held to HF + PEFT in tests/models/test_lora.py); one step mixes several
adapters and the base; adapters' weights are pool owners of their own, evicted with their base
and when idle, brought back for their requests; unloading waits for the requests in flight. Every
test ends with the pool's and every model's integrity checked, owner by owner."""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import pytest

from kvpool.host_copy import _copy_thread as copier
from models.attention.base import ForwardContext
from models.layers.fp8_linear import Fp8Linear
from models.lora import AdapterError
from models.lora.synthetic import write_adapters
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call
from prism_server.engine.engine import Engine
from prism_server.served_model import ModelNotFound
from scheduler.sampling_params import SamplingParams
from tests.prism_server.lora_setup import SPECS, edited, make_set, solo_tokens

PAGE = 64 << 10
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
PROMPTS: dict[str | None, list[int]] = {
    None: [5, 17, 60, 3, 9],
    "sql": [8, 8, 1, 90, 4000],
    "chat": [33, 2, 71, 12],
    "kv": [64, 3, 5, 1000, 20, 7],
    "mlp": [1, 2, 3, 4, 5, 6, 7],
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the base's directory, the adapters' directories, each prompt's solo tokens)."""
    base, dirs, _ = make_set(tmp_path_factory.mktemp("lora-engine"))
    return base, dirs, solo_tokens(base, dirs, PROMPTS, NEW)


def config(made, max_loras: int = 8, **kw) -> EngineConfig:
    base, dirs, _ = made
    specs = (ModelSpec("base", str(base), block_size=4),) + tuple(
        ModelSpec(n, base="base", adapter=str(d)) for n, d in dirs.items()
    )
    kw.setdefault("kv_budget_bytes", 64 * PAGE)
    return EngineConfig(models=specs, device="cpu", page_bytes=PAGE, max_loras=max_loras, **kw)


def run(e: Engine, requests: list[tuple[str | None, list[int]]]) -> list[Completion]:
    """The requests submitted together, each to its adapter (None: the base); waits for all."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    out = []
    for adapter, prompt in requests:
        c = Completion(prompt, arrival_time=time.monotonic())

        def sink(o, c=c):
            c.add(o, time.monotonic())
            if o.finished:
                done.put(None)

        e.add_request(adapter or "base", prompt, GREEDY, sink)
        out.append(c)
    for _ in out:
        done.get(timeout=60)
    return out


def running(e: Engine, adapter: str, params: SamplingParams):
    """A request of `adapter` (its PROMPTS prompt) submitted and running: (its Completion, a
    queue that gets None once it ends)."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    c = Completion(PROMPTS[adapter], arrival_time=time.monotonic())

    def sink(o):
        c.add(o, time.monotonic())
        if o.finished:
            done.put(None)

    e.add_request(adapter, PROMPTS[adapter], params, sink)
    while not c.token_ids:  # it runs
        time.sleep(0.005)
    return c, done


def fill_the_pool(e: Engine):
    """Every adapter evicted (each needs a page again), then every free page of the pool held
    by a filler buffer that takes nobody's; -> the filler (unmap and close it on the engine
    thread to give its pages back)."""
    import torch

    from kvpool import WeightBuffer, WeightLayout

    w = e.worker
    for _ in SPECS:
        assert w.call(lambda: w.memory.evict_idle_adapter(None))
    layout = WeightLayout.pack([("w", (e.pool.num_available * PAGE - 4096,), torch.uint8)])

    def fill():
        wb = WeightBuffer(e.pool, "filler/weights", layout, reclaim=False)
        assert wb.map() and e.pool.num_available == 0
        return wb

    return w.call(fill)


def owners_whole(e: Engine) -> dict[str, int]:
    """The pool's and each model's integrity, and every adapter's pages as its snapshot says;
    -> the pool's pages per owner."""
    e.check_integrity()
    owned = e.pool.stats().owned
    for a in e.worker.snapshot_now().model("base").adapters:
        assert owned.get(f"{a.name}/weights", 0) == a.weight_pages == (1 if a.resident else 0)
    return owned


def record_steps(e: Engine) -> list[list[int]]:
    """Each eager step's token slots from now on (the base's runner)."""
    steps: list[list[int]] = []

    def hook():
        runner = e.worker.models["base"].runner
        forward = runner._forward

        def recorded(*args, lora=None, **kw):
            steps.append(lora.token_slots.tolist() if lora is not None else [])
            return forward(*args, lora=lora, **kw)

        runner._forward = recorded

    e.worker.execute(Call(hook))
    return steps


def test_config_adapters_give_their_solo_tokens_in_steps_mixing_them_with_the_base(
    made, steps_ahead
):
    ref = made[2]
    with Engine(config(made)) as e:
        steps = record_steps(e)
        got = run(e, list(PROMPTS.items()))
        for (adapter, _), c in zip(PROMPTS.items(), got):
            assert c.error is None and c.token_ids == ref[adapter], adapter
        mixed = [set(s) for s in steps if len(set(s) - {-1}) >= 3 and -1 in s]
        assert mixed, steps  # some step ran 3+ adapters and the base together
        owned = owners_whole(e)
        assert {f"{n}/weights" for n in SPECS} <= set(owned)
        # an adapter's requests never share the prefix cache with the base's or another's
        again = run(e, [("sql", PROMPTS["sql"]), (None, PROMPTS["sql"])])
        assert again[0].token_ids == ref["sql"]
        assert again[1].token_ids != ref["sql"]
        owners_whole(e)


def test_more_adapters_with_work_than_slots_take_turns(made, steps_ahead):
    """Two slots, four adapters with two requests each: each request its solo tokens."""
    ref = made[2]
    with Engine(config(made, max_loras=2)) as e:
        reqs = [(a, PROMPTS[a]) for a in SPECS] * 2
        for (adapter, _), c in zip(reqs, run(e, reqs)):
            assert c.error is None and c.token_ids == ref[adapter], adapter
        slots = [a.slot for a in e.worker.snapshot_now().model("base").adapters]
        assert sorted(s for s in slots if s is not None) == [0, 1]
        owners_whole(e)


def test_evicting_the_base_frees_every_page_of_its_adapters_and_they_come_back(made):
    ref = made[2]
    with Engine(config(made)) as e:
        run(e, [(a, PROMPTS[a]) for a in SPECS])
        before = owners_whole(e)
        assert all(before[f"{a}/weights"] == 1 for a in SPECS)
        e.evict("base")
        owned = owners_whole(e)
        assert owned["base/weights"] == owned["base"] == 0
        assert all(owned[f"{a}/weights"] == 0 for a in SPECS)
        assert e.pool.stats().free + sum(owned.values()) >= sum(before.values())
        snap = e.worker.snapshot_now().model("base")
        assert not any(a.resident for a in snap.adapters)
        # an adapter's request brings its base back, then the adapter
        (c,) = run(e, [("chat", PROMPTS["chat"])])
        assert c.token_ids == ref["chat"]
        snap = e.worker.snapshot_now().model("base")
        assert snap.residency.value == "resident"
        by_name = {a.name: a for a in snap.adapters}
        assert by_name["chat"].resident and by_name["chat"].activations == 1
        assert not by_name["sql"].resident  # idle: stays offloaded
        owners_whole(e)


def test_idle_adapters_are_evicted_first_for_room_and_come_back(made):
    """The pool's room is made from idle adapters before any model: each gives its page back
    (a PageMove logged), then its next request activates it again, tokens unchanged."""
    ref = made[2]
    with Engine(config(made)) as e:
        run(e, [(a, PROMPTS[a]) for a in SPECS])
        w = e.worker
        free = e.pool.num_available
        need = free + 2  # two pages more than the pool has free
        evicted = w.call(lambda: w.memory.make_room(lambda: e.pool.num_available >= need, 0.0))
        assert evicted == []  # no model went: two idle adapters were enough
        snap = w.snapshot_now()
        assert snap.model("base").residency.value == "resident"
        gone = [a.name for a in snap.model("base").adapters if not a.resident]
        assert len(gone) == 2
        assert [m.giver for m in snap.moves[-2:]] == gone
        reqs = [(a, PROMPTS[a]) for a in gone]
        for (adapter, _), c in zip(reqs, run(e, reqs)):
            assert c.token_ids == ref[adapter]
        assert all(a.resident for a in w.snapshot_now().model("base").adapters)
        owners_whole(e)


def test_unloading_lets_the_requests_in_flight_finish_and_frees_the_adapter(made, steps_ahead):
    ref = made[2]
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with Engine(config(made)) as e:
        c, done = running(e, "sql", long)
        stale = e.model("sql")  # a handle looked up before the unload (a request in flight)
        gone: Future = e.adapters.start_unload("sql")
        with pytest.raises(ModelNotFound):  # new requests: 404 at once
            e.model("sql")
        done.get(timeout=60)
        gone.result(timeout=30)
        assert c.error is None and len(c.token_ids) == 40 and c.token_ids[:NEW] == ref["sql"]
        owned = owners_whole(e)
        assert "sql" not in {a.name for a in e.worker.snapshot_now().model("base").adapters}
        assert owned.get("sql/weights", 0) == 0
        # a request that was looked up before the unload and submitted after: refused at
        # once (the frontend's 404), never sent to a device that no longer has its adapter
        with pytest.raises(ModelNotFound):
            e.submit(stale, PROMPTS["sql"], GREEDY, lambda out: None)
        # loaded again at run time, under its old name: the same tokens
        e.adapters.start_load("sql", made[1]["sql"]).result(timeout=30)
        (again,) = run(e, [("sql", PROMPTS["sql"])])
        assert again.token_ids == ref["sql"]
        owners_whole(e)


def test_a_load_while_its_name_is_unloading_waits_for_the_unload(made, steps_ahead):
    """Unload an adapter with a request in flight, and load it again at once (a request that
    finds it in lora_dirs does so): the load waits for the unload to finish, then serves."""
    ref = made[2]
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with Engine(config(made)) as e:
        (before,) = run(e, [("sql", PROMPTS["sql"])])
        c, done = running(e, "sql", long)
        gone = e.adapters.start_unload("sql")
        back = e.adapters.start_load("sql", made[1]["sql"])
        assert back.result(timeout=60).name == "sql"
        assert gone.done() and gone.exception() is None
        done.get(timeout=60)
        assert c.error is None and len(c.token_ids) == 40
        (again,) = run(e, [("sql", PROMPTS["sql"])])
        assert again.token_ids == before.token_ids == ref["sql"]
        owners_whole(e)


def test_a_loaded_adapter_is_in_the_published_snapshot_when_its_load_answers(
    made, tmp_path, monkeypatch
):
    """A busy device publishes every _PUBLISH_S at most (here: never on its own): a load
    answers once the published snapshot (what /v1/models reads) has the adapter."""
    from prism_server.engine import device_worker

    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with Engine(config(made)) as e:
        done: queue.SimpleQueue = queue.SimpleQueue()
        e.add_request("base", PROMPTS[None], long, lambda o: o.finished and done.put(o))
        while e.model_snapshot("base").num_running == 0:  # the device steps it
            time.sleep(0.005)
        monkeypatch.setattr(device_worker, "_PUBLISH_S", 3600.0)
        extra = edited(made[1]["sql"], tmp_path / "extra")
        e.adapters.start_load("extra", str(extra)).result(timeout=30)
        published = e.snapshots()[0].model("base")
        assert "extra" in {a.name for a in published.adapters}
        assert published.num_running == 1  # (the device was busy all along)
        monkeypatch.setattr(device_worker, "_PUBLISH_S", 0.005)
        assert done.get(timeout=120).error is None
        owners_whole(e)


def test_adapters_take_their_host_copies_from_the_host_budget(made):
    """Each adapter's host copy takes its bytes from host_budget_bytes: a load past it is
    refused (MemoryError: the API's 503) with nothing placed, and an unload gives them back."""
    base, dirs, _ = made
    spec = ModelSpec("base", str(base), block_size=4)
    kw = dict(device="cpu", page_bytes=PAGE, kv_budget_bytes=64 * PAGE)
    with Engine(EngineConfig(models=(spec,), **kw)) as e:
        models = e.host_budget.used
        e.adapters.start_load("sql", str(dirs["sql"])).result(timeout=30)
        one = e.host_budget.used - models
    assert models > 0 and one > 0
    cfg = EngineConfig(models=(spec,), host_budget_bytes=models + one + one // 2, **kw)
    with Engine(cfg) as e:
        e.adapters.start_load("sql", str(dirs["sql"])).result(timeout=30)
        before = e.pool.stats().owned
        with pytest.raises(MemoryError, match="adapter kv .* does not fit the host budget"):
            e.adapters.start_load("kv", str(dirs["sql"])).result(timeout=30)
        assert "kv" not in e.served and e.pool.stats().owned == before
        e.adapters.start_unload("sql").result(timeout=30)
        assert e.host_budget.used == models
        e.adapters.start_load("kv", str(dirs["sql"])).result(timeout=30)
        (c,) = run(e, [("kv", PROMPTS["sql"])])
        assert c.token_ids == made[2]["sql"]
        owners_whole(e)


def test_a_run_time_adapter_finds_its_base_among_several_by_its_config(made, tmp_path):
    """Its config's base_model_name_or_path names a served base (by its source's path, or by
    name); a directory that is not there, or a config naming none of them, gets a clear error
    naming the problem, before anything is sent to a device."""
    base, dirs, _ = made
    specs = (ModelSpec("base", str(base), block_size=4), ModelSpec("other", "dummy:tiny-llama"))
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, kv_budget_bytes=64 * PAGE)
    with Engine(cfg) as e:
        by_path = edited(dirs["sql"], tmp_path / "by-path", {"base_model_name_or_path": str(base)})
        assert e.adapters.start_load("a", str(by_path)).result(timeout=30).spec.base == "base"
        by_name = edited(dirs["sql"], tmp_path / "by-name", {"base_model_name_or_path": "base"})
        assert e.adapters.start_load("b", str(by_name)).result(timeout=30).spec.base == "base"
        (got,) = run(e, [("b", PROMPTS["sql"])])
        assert got.token_ids == made[2]["sql"]
        with pytest.raises(AdapterError, match="is not a directory"):
            e.adapters.start_load("lost", str(tmp_path / "nowhere"))
        stray = edited(dirs["sql"], tmp_path / "stray", {"base_model_name_or_path": "llama-70b"})
        with pytest.raises(AdapterError, match="which base model it adapts is not known"):
            e.adapters.start_load("stray", str(stray))
        assert {"lost", "stray"}.isdisjoint(e.served)
        owners_whole(e)


@pytest.mark.parametrize(
    "models, error",
    [
        ((ModelSpec("a", base="nope", adapter="/x"),), "its base 'nope' is not a configured"),
        (
            (
                ModelSpec("b", "dummy:tiny-llama"),
                ModelSpec("a1", base="b", adapter="/x"),
                ModelSpec("a2", base="a1", adapter="/y"),
            ),
            "is itself an adapter",
        ),
    ],
)
def test_adapter_entries_are_checked(models, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(models=models)


def test_adapter_entry_fields():
    with pytest.raises(ValueError, match="takes no source"):
        ModelSpec("a", "dummy:tiny-llama", base="b", adapter="/x")
    with pytest.raises(ValueError, match="names both base and adapter"):
        ModelSpec("a", base="b")
    with pytest.raises(ValueError, match="source is required"):
        ModelSpec("a")
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)


def test_adapters_from_a_config_file_and_flags(tmp_path):
    from prism_server.server_args import load_server_args

    toml = tmp_path / "prism.toml"
    toml.write_text(
        '[engine]\nmax_loras = 4\nlora_dirs = ["/adapters"]\n'
        '[[models]]\nname = "llama8b"\nsource = "dummy:tiny-llama"\n'
        '[[models]]\nname = "sql-helper"\nbase = "llama8b"\nadapter = "/adapters/sql"\n'
    )
    args = load_server_args(str(toml))
    sql = args.models[1]
    assert (sql.base, sql.adapter, sql.is_adapter) == ("llama8b", "/adapters/sql", True)
    assert args.engine.max_loras == 4 and args.engine.lora_dirs == ("/adapters",)
    flags = ["b=dummy:tiny-llama", "chat,base=b,adapter=/adapters/chat"]
    args = load_server_args(None, flags)
    assert args.models[1] == ModelSpec("chat", base="b", adapter="/adapters/chat")


def test_an_adapter_short_of_pages_takes_them_from_an_idle_model(made):
    """The pool full (an idle model resident, the rest taken): an adapter's request evicts
    the idle model for its adapter's page (the balloon's order), and runs with its tokens."""
    ref = made[2]
    cfg = config(made)
    other = ModelSpec("other", "dummy:tiny-llama", block_size=4)
    cfg = EngineConfig(**{**cfg.__dict__, "models": (*cfg.models, other)})
    with Engine(cfg) as e:
        run(e, [(None, PROMPTS[None])])
        w = e.worker
        filler = fill_the_pool(e)
        try:
            (c,) = run(e, [("sql", PROMPTS["sql"])])
            assert c.error is None and c.token_ids == ref["sql"]
            snap = w.snapshot_now()
            assert snap.model("other").residency.value == "offloaded"
            assert any(m.giver == "other" and m.taker == "base" for m in snap.moves)
            sql = next(a for a in snap.model("base").adapters if a.name == "sql")
            assert sql.resident and sql.activations == 1
        finally:
            w.call(lambda: (filler.unmap(), filler.close()))
        owners_whole(e)


def test_an_adapter_loaded_into_a_full_pool_waits_offloaded_for_its_first_request(made, tmp_path):
    """No page to be had (every adapter evicted, the rest of the pool held): a run-time load
    still succeeds, the adapter registered offloaded (its host copy made from its tensors);
    once pages are free its first request activates it and gets its tokens."""
    ref = made[2]
    with Engine(config(made)) as e:
        w = e.worker
        filler = fill_the_pool(e)
        try:
            extra = edited(made[1]["sql"], tmp_path / "extra")
            assert e.adapters.start_load("extra", str(extra)).result(timeout=30).name == "extra"
            snap = w.snapshot_now().model("base")
            got = next(a for a in snap.adapters if a.name == "extra")
            assert not got.resident and got.weight_pages == 0 and got.activations == 0
        finally:
            w.call(lambda: (filler.unmap(), filler.close()))
        (c,) = run(e, [("extra", PROMPTS["sql"])])
        assert c.error is None and c.token_ids == ref["sql"]
        got = next(a for a in w.snapshot_now().model("base").adapters if a.name == "extra")
        assert got.resident and got.activations == 1
        owners_whole(e)


def test_adapters_waiting_in_a_tight_pool_never_starve_the_first_request(tmp_path):
    """A pool with room for the base, about two adapters and little KV; 40 requests over four
    adapters (two slots) and the base at once. Adapters made resident for requests that wait
    could hold the pages the first request's KV needs, nothing running to free any (seen:
    every request waiting for good). Each request must end, with its tokens alone."""
    names = ["ad-0", "ad-1", "ad-2", "ad-3"]
    write_adapters(tmp_path, "tiny-llama", names, rank=8, seed=0)
    base = ModelSpec("base", "dummy:tiny-llama", block_size=4, max_num_batched_tokens=64)
    specs = (base, *(ModelSpec(n, base="base", adapter=str(tmp_path / n)) for n in names))
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, max_loras=2,
                       kv_budget_bytes=3 * PAGE)  # fmt: skip
    rng = random.Random(0)
    jobs = [(rng.choice([*names, None]), rng.randrange(1, 90)) for _ in range(40)]
    prompts = {n: [(7 * n + 3 * i) % 500 + 3 for i in range(n)] for _, n in jobs}
    with Engine(cfg) as e:
        alone = {j: run(e, [(j[0], prompts[j[1]])])[0].token_ids for j in set(jobs)}
        together = run(e, [(a, prompts[n]) for a, n in jobs])
        for j, c in zip(jobs, together):
            assert c.error is None and c.token_ids == alone[j], j
        owners_whole(e)


class _GraphsTakingLora:
    """A GPU runner's decode graphs, stood in for on the CPU (where a base's slots run the torch
    GEMMs, not the kernels a real graph captures): a "replay" runs the step eagerly with the
    LoRA work its static input would hold, and records the token slots it was handed (None: a
    replay of a graph without LoRA work)."""

    def __init__(self, runner):
        self.runner = runner
        self.replays: list[list[int] | None] = []

    def can_run(self, md) -> bool:
        return md.is_decode_only

    def takes_lora(self, slots) -> bool:
        return slots is self.runner.lora.slots

    def run(self, input_ids, positions, md, planned=None, lora=None):
        self.replays.append(None if lora is None else list(lora[1]))
        work = None if lora is None else lora[0].batch(lora[1], input_ids.device)
        r = self.runner
        ctx = ForwardContext(attn=r.attention(r.kv_cache.layer_views, md), lora=work)
        return r.model.compute_logits(r.model(input_ids, positions, ctx))


class _NoPieces:
    """Piecewise graphs, captured without LoRA work: a step with some must never reach them."""

    def fits(self, num_tokens: int) -> bool:
        return True

    def run(self, *args, **kw):
        raise AssertionError("a step with LoRA work reached piecewise graphs captured without it")


def test_decode_steps_with_lora_work_replay_graphs_and_prefills_run_eagerly(made, steps_ahead):
    """Decode steps mixing adapters and the base go to the decode graphs with each token's
    slot (the base's NO_ADAPTER), the base's own decode steps to them without LoRA work; steps
    with LoRA work that are not decodes run eagerly, never in a piecewise graph; every request
    gets its solo tokens."""
    ref = made[2]
    with Engine(config(made)) as e:
        w = e.worker
        graphs: list[_GraphsTakingLora] = []
        eager: list[tuple[bool, bool]] = []  # (a decode step, with LoRA work)

        def stand_ins():
            runner = w.models["base"].runner
            graphs.append(_GraphsTakingLora(runner))
            runner.graphs, runner.pieces = graphs[0], _NoPieces()
            forward = runner._forward

            def recorded(input_ids, pos, md, *args, lora=None, **kw):
                eager.append((md.is_decode_only, lora is not None))
                return forward(input_ids, pos, md, *args, lora=lora, **kw)

            runner._forward = recorded

        (warm,) = run(e, [("sql", PROMPTS["sql"])])  # (the adapters: loaded, runner made)
        assert warm.token_ids == ref["sql"]
        w.execute(Call(stand_ins))
        got = run(e, list(PROMPTS.items()))
        for (adapter, _), c in zip(PROMPTS.items(), got):
            assert c.error is None and c.token_ids == ref[adapter], (adapter, c.error)
        replays = graphs[0].replays
        slots = {a.name: a.slot for a in w.snapshot_now().model("base").adapters}
        mixed = [r for r in replays if r is not None and -1 in r and len(set(r) - {-1}) >= 3]
        assert mixed, replays  # decodes of 3+ adapters and the base in one graph replay
        for r in replays:  # one token a sequence: each of an adapter's slot or the base's
            assert r is None or set(r) <= set(slots.values()) | {-1}
        assert eager and all(not decode and lora for decode, lora in eager), eager
        n = len(replays)
        w.execute(Call(lambda: setattr(w.models["base"].runner, "pieces", None)))
        (base,) = run(e, [(None, PROMPTS[None])])  # the base's alone
        assert base.error is None and base.token_ids == ref[None]
        assert len(replays) > n and all(r is None for r in replays[n:])
        owners_whole(e)


def test_an_adapters_activation_copy_runs_while_its_base_serves_on(made):
    """An evicted adapter's request starts its copy and waits for it (charged to activation,
    the adapter `activating` meanwhile) while the base's own request runs; once the copy lands
    the adapter's request runs with its solo tokens. An adapter evicted with its copy in flight
    waits for the copy before its pages go."""
    ref = made[2]
    adapter = "sql"
    with Engine(config(made)) as e:
        run(e, [(adapter, PROMPTS[adapter])])
        w = e.worker
        assert w.call(lambda: w.models["base"].evict_adapter(adapter)) == 1
        gate = threading.Event()
        copier().submit(gate.wait)  # the copy thread is busy: the adapter's copy queues
        try:
            got: dict[str | None, Completion] = {}
            waits: dict[str | None, dict] = {}
            finished: queue.SimpleQueue = queue.SimpleQueue()
            for name in (adapter, None):
                c = got[name] = Completion(PROMPTS[name], arrival_time=time.monotonic())

                def sink(o, c=c, name=name):
                    c.add(o, time.monotonic())
                    if o.finished:
                        waits[name] = o.waits
                        finished.put(name)

                e.add_request(name or "base", PROMPTS[name], GREEDY, sink)
            assert finished.get(timeout=60) is None  # the base's request, while the copy waits
            (a,) = [x for x in w.snapshot_now().model("base").adapters if x.name == adapter]
            assert a.activating and a.residency == "activating" and a.num_waiting == 1
        finally:
            gate.set()
        assert finished.get(timeout=60) == adapter
        assert got[adapter].token_ids == ref[adapter] and got[None].token_ids == ref[None]
        assert waits[adapter]["activation"] > 0 and waits[None]["activation"] == 0
        (a,) = [x for x in w.snapshot_now().model("base").adapters if x.name == adapter]
        assert a.resident and not a.activating and a.activations == 1
        # evicted while its copy is in flight: the copy lands first, then the pages go
        assert w.call(lambda: w.models["base"].evict_adapter(adapter)) == 1
        gate.clear()
        copier().submit(gate.wait)
        try:
            adapters = w.models["base"].adapters
            started = w.call(lambda: adapters.prepare([adapter], set(), 0.0))
            assert started == set() and adapters.loading == {adapter}
            threading.Timer(0.2, gate.set).start()
            assert w.call(lambda: w.models["base"].evict_adapter(adapter)) == 1
            assert adapters.loading == set()
        finally:
            gate.set()
        owners_whole(e)


def test_adapters_of_an_fp8_base_give_their_solo_tokens(made):
    """A base served in FP8 (its projections E4M3 in its pages and host copy) runs its adapters'
    deltas over its FP8 layers: each request, in one batch with the others, gets the tokens the
    model-level path gives it alone over the same FP8 base."""
    base, dirs, _ = made
    want = solo_tokens(base, dirs, PROMPTS, NEW, quantization="fp8")
    cfg = config(made)
    specs = (replace(cfg.models[0], quantization="fp8"), *cfg.models[1:])
    with Engine(replace(cfg, models=specs)) as e:
        layers = e.worker.models["base"].runner.model.modules()
        assert sum(isinstance(m, Fp8Linear) for m in layers) == 8  # 2 layers x 4 projections
        reqs = [(a, PROMPTS[a]) for a in PROMPTS]
        for (adapter, _), c in zip(reqs, run(e, reqs)):
            assert c.token_ids == want[adapter], adapter
        owners_whole(e)
