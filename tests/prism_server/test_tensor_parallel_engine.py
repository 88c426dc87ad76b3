"""A model split over two (emulated) devices in one engine: each shard's weights and KV in its
own device's pool, stepped by the first device's engine thread. It gives the whole model's
greedy tokens, serves beside a model of the other device, is evicted and activated with every
shard at once (the same tokens after), is never moved, and every page comes back; asking for
more devices than the engine has is a clear error."""

from __future__ import annotations

import pytest

from models.lora import AdapterError
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import TransitionRefused
from prism_server.engine.engine import Engine
from scheduler.sampling_params import SamplingParams
from tests.models.test_loader import _save_hf_dir, _tiny_hf_llama

PAGE = 64 << 10
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 200, 3, 99], [42, 7, 250, 11, 64, 1, 180, 9, 9, 30, 31, 32, 33]]


def count_calls(obj, method: str) -> list[int]:
    """Counts the calls of obj.method from now on (in a one-element list)."""
    calls, fn = [0], getattr(obj, method)

    def counting(*a, **k):
        calls[0] += 1
        return fn(*a, **k)

    setattr(obj, method, counting)
    return calls


def _engine(path, tp: int, devices: int, pinned: bool = False) -> Engine:
    specs = (
        ModelSpec("m", str(path), block_size=4, tensor_parallel=tp, pinned=pinned),
        ModelSpec("other", "dummy:tiny-llama", block_size=4),
    )
    cfg = EngineConfig(
        models=specs, device="cpu", devices=devices, page_bytes=PAGE, plan_interval_s=3600.0
    )
    return Engine(cfg)


def test_a_model_split_over_two_devices_gives_the_whole_models_tokens(tmp_path, steps_ahead):
    """Also with its decode steps launched before the last one's tokens are read."""
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 1, 1) as whole:
        want = [o.token_ids for o in whole.generate("m", PROMPTS, PARAMS)]
    with _engine(path, 2, 2) as e:
        split = next(w for w in e.workers if "m" in w.models).models["m"]
        assert split.launch_ahead is steps_ahead
        launched = count_calls(split, "_step_ahead")
        got = [o.token_ids for o in e.generate("m", PROMPTS, PARAMS)]
        assert got == want
        assert (launched[0] > 0) is steps_ahead
        assert len(e.generate("other", [[5, 6, 7]], PARAMS)[0].token_ids) == 12
        lead = e.served["m"].device
        pools = {w.name: w.pool for w in e.workers}
        follower = next(n for n in pools if n != lead)
        assert pools[follower].pages_of("m/weights.1") > 0  # the second shard's weights there
        assert pools[follower].pages_of("m") == pools[lead].pages_of("m")  # KV: the same pages
        e.evict("m")  # every shard's weights leave its pool
        assert pools[lead].pages_of("m/weights") == pools[follower].pages_of("m/weights.1") == 0
        assert e.model_snapshot("m").residency.name == "OFFLOADED"
        assert not e.migrate("m", follower)  # a split model stays where it is
        e.check_integrity()
        again = [o.token_ids for o in e.generate("m", PROMPTS, PARAMS)]  # activates both shards
        assert again == want and pools[follower].pages_of("m/weights.1") > 0
        cached = e.generate("m", PROMPTS[1:], PARAMS)[0]  # its full blocks from the prefix cache
        assert cached.token_ids == want[1] and cached.num_cached_tokens > 0
        e.check_integrity()


def test_a_pinned_split_model_is_never_evicted(tmp_path):
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 2, 2, pinned=True) as e:
        with pytest.raises(TransitionRefused, match="pinned"):
            e.evict("m")
        e.check_integrity()


def test_an_adapter_of_a_split_model_is_refused_and_the_model_serves_on(tmp_path):
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 2, 2) as e:
        with pytest.raises(AdapterError, match="split over devices"):
            e.adapters.start_load("a", str(tmp_path / "a"), "m").result()
        assert "a" not in e.served
        assert len(e.generate("m", PROMPTS[:1], PARAMS)[0].token_ids) == 12
        e.check_integrity()


def test_more_shards_than_devices_are_refused(tmp_path):
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with pytest.raises(ValueError, match="tensor_parallel = 2, but the engine has 1 device"):
        _engine(path, 2, 1)


def test_a_split_model_under_the_control_loop_beside_models_that_move(tmp_path):
    """The control loop plans every 50 ms over two devices while all four models serve: the
    split model keeps serving the whole model's tokens, and every page comes back."""
    import threading

    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 1, 1) as whole:
        want = [o.token_ids for o in whole.generate("m", PROMPTS, PARAMS)]
    specs = (
        ModelSpec("m", str(path), block_size=4, tensor_parallel=2),
        *(ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate("abc")),
    )
    cfg = EngineConfig(models=specs, device="cpu", devices=2, page_bytes=PAGE, plan_interval_s=0.05)
    with Engine(cfg) as e:
        got: dict[str, list] = {}

        def serve(name: str) -> None:
            for _ in range(3):
                got.setdefault(name, []).append(
                    [o.token_ids for o in e.generate(name, PROMPTS, PARAMS)]
                )

        threads = [threading.Thread(target=serve, args=(n,)) for n in "mabc"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got["m"] == [want] * 3
        assert all(len(got[n]) == 3 for n in "abc")
        snap = e.model_snapshot("m")  # the plan sees the other shard's bytes on its device
        ((device, nbytes),) = snap.shard_weight_bytes
        assert device != e.served["m"].device and 0 < nbytes < snap.weight_bytes
        assert e.control.last is not None  # the loop planned with it (every 50 ms)
        e.check_integrity()


def test_a_split_model_short_on_its_other_device_gets_idle_models_evicted_there():
    """Each device holds two idle models' weights and a shard of the split one, the second one
    a single page free: the split model's request needs more there, so that device evicts an
    idle model for it (not the lead device, whose pages are not what it waits for)."""
    import threading

    tiny = [ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate("abcd")]
    split = ModelSpec("t", "dummy:tiny-llama", block_size=4, tensor_parallel=2)
    cfg = EngineConfig(
        models=(*tiny, split), device="cpu", devices=2, page_bytes=PAGE, pool_budget_bytes=27 * PAGE
    )
    with Engine(cfg) as e:
        lead = e.served["t"].device
        other = next(w for w in e.workers if w.name != lead)
        assert other.pool.num_available <= 1  # (the set-up: its last page)
        params = SamplingParams(max_tokens=186, temperature=0, ignore_eos=True)
        out: list = []
        run = threading.Thread(target=lambda: out.extend(e.generate("t", [[5] * 179], params)))
        run.start()
        run.join(timeout=60)
        assert out and len(out[0].token_ids) == 186
        residency = {m.name: m.residency.value for m in other.snapshot_now().models}
        assert "offloaded" in residency.values()  # an idle model there made the room
        e.check_integrity()


@pytest.mark.parametrize("policy", ["static", "swap"])
def test_the_baselines_serve_a_split_model(tmp_path, policy):
    """Static partitions (every model resident, a KV quota each) and time-sharing swaps (the
    split model evicted and activated in turn, both shards at once) serve it too."""
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 1, 1) as whole:
        want = [o.token_ids for o in whole.generate("m", PROMPTS, PARAMS)]
    with _mxy(path, policy=policy) as e:
        for _ in range(2):
            for n in "xy":
                assert len(e.generate(n, [[5, 6, 7]], PARAMS)[0].token_ids) == 12
            assert [o.token_ids for o in e.generate("m", PROMPTS, PARAMS)] == want
        e.check_integrity()


def _mxy(
    path, pages: int | None = None, policy: str = "prism", ttft_slo_ms: float | None = None
) -> Engine:
    """The split model m and two dummies, x and y, over two devices; pages: each pool's
    capacity (None: the default, room for everything); ttft_slo_ms: the dummies' (None: a
    multiple of their profiled prefill)."""
    specs = (
        ModelSpec("m", str(path), block_size=4, tensor_parallel=2),
        ModelSpec("x", "dummy:tiny-llama", block_size=4, ttft_slo_ms=ttft_slo_ms),
        ModelSpec("y", "dummy:tiny-llama", block_size=4, seed=1, ttft_slo_ms=ttft_slo_ms),
    )
    cfg = EngineConfig(
        models=specs,
        device="cpu",
        devices=2,
        page_bytes=PAGE,
        pool_budget_bytes=(pages + 1) * PAGE if pages else None,
        policy=policy,
        plan_interval_s=3600.0,
    )
    return Engine(cfg)


def _mxy_layout(path) -> tuple[dict[str, str], int, int]:
    """Where the planner puts each of _mxy's models (with room for all), the pages of m's
    shard (the same on both devices) and those of a dummy's weights."""
    with _mxy(path) as e:
        where = {n: s.device for n, s in e.served.items()}
        pools = {w.name: w.pool for w in e.workers}
        shard = pools[where["m"]].pages_of("m/weights")
        other = next(d for d in pools if d != where["m"])
        assert pools[other].pages_of("m/weights.1") == shard
        return where, shard, pools[where["x"]].pages_of("x/weights")


def test_a_split_model_gets_room_on_its_other_device_from_that_devices_thread(tmp_path):
    """Both pools exactly full (the split model's shard and an idle model on each device): the
    split model's requests need KV pages on both. Its own device evicts its idle model; the
    other device, asked by it, evicts the idle model there (its pages are that device's
    thread's to give). Evicted, the split model comes back the same way, and every page adds
    up."""
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    with _engine(path, 1, 1) as whole:
        want = [o.token_ids for o in whole.generate("m", PROMPTS, PARAMS)]
    where, shard, size = _mxy_layout(path)
    other = next(d for d in set(where.values()) if d != where["m"])
    idle = {d: next(n for n in "xy" if where[n] == d) for d in set(where.values())}  # one each
    with _mxy(path, shard + size) as e:  # each pool: the shard and the idle model, nothing free
        pools = {w.name: w.pool for w in e.workers}
        assert {n: s.device for n, s in e.served.items()} == where
        assert all(p.num_available == 0 for p in pools.values())
        assert [o.token_ids for o in e.generate("m", PROMPTS, PARAMS)] == want
        for d, n in idle.items():
            assert e.model_snapshot(n).residency.name == "OFFLOADED", (d, n)
        e.evict("m")
        e.generate(idle[other], [[5, 6, 7]], PARAMS)  # back on the other device
        assert [o.token_ids for o in e.generate("m", PROMPTS, PARAMS)] == want
        e.check_integrity()


def test_the_other_device_gets_its_pages_back_from_an_idle_split_model(tmp_path):
    """Each pool exactly the shard and the model placed there. The split model serves (both
    other models evicted for it) and idles, keeping a KV page in each pool. Then the model of
    the other device needs its weights back: that device cannot evict what it does not step,
    so it asks the split model's device, which evicts the idle split model. Both serve in
    turn, and every page adds up."""
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    where, shard, size = _mxy_layout(path)
    other = next(n for n in "xy" if where[n] != where["m"])  # the model of the other device
    with _mxy(path, shard + size) as e:
        assert {n: s.device for n, s in e.served.items()} == where
        assert len(e.generate("m", PROMPTS[:1], PARAMS)[0].token_ids) == 12
        assert e.model_snapshot(other).residency.name == "OFFLOADED"
        assert len(e.generate(other, [[5, 6, 7]], PARAMS)[0].token_ids) == 12
        assert e.model_snapshot("m").residency.name == "OFFLOADED"  # released for it
        assert len(e.generate("m", PROMPTS[:1], PARAMS)[0].token_ids) == 12  # m's turn again
        e.check_integrity()


@pytest.mark.slow
def test_a_busy_split_model_gives_up_a_request_for_the_other_devices_new_work(
    tmp_path, steps_ahead
):
    """Each pool the shard, the model placed there and one page. The split model decodes two
    long requests, its KV (one page) on both devices, the other models evicted for it. Then
    the model of the other device gets a request: it activates, but its KV page is the split
    model's. Nothing there is idle, so that device asks the split model's device, which
    preempts the split model's requests (each once) and holds the page it frees there for the
    asker. The asker serves while the split model is still busy; the split model then
    finishes with the whole model's tokens, and every page adds up."""
    import threading
    import time

    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    long = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    with _engine(path, 1, 1) as whole:
        want = [o.token_ids for o in whole.generate("m", PROMPTS, long)]
    where, shard, size = _mxy_layout(path)
    other = next(n for n in "xy" if where[n] != where["m"])  # the model of the other device
    # the asker's TTFT deadline far off: new work past it would preempt nothing, and a loaded
    # machine's activation can outlast a deadline of a few prefills
    with _mxy(path, shard + size + 1, ttft_slo_ms=60_000.0) as e:
        lead = e.served["m"].device
        there = next(w for w in e.workers if w.name != lead).pool
        done: dict[str, float] = {}
        got: list = []

        def split_model():
            outs = e.generate("m", PROMPTS, long)
            got.extend(o.token_ids for o in outs)
            # when its last request finished, stamped on the engine thread (not when this thread
            # woke: on a loaded machine that can come later than the other model's finish)
            done["m"] = max(o.finish_time for o in outs)

        t = threading.Thread(target=split_model)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            e.model_snapshot(other).residency.name != "OFFLOADED" or not there.pages_of("m")
        ):
            time.sleep(0.005)  # the split model's KV took the other device's model's room
        assert "m" not in done, "the split model finished before the test could interfere"
        (out,) = e.generate(other, [[5, 6, 7]], PARAMS)
        assert len(out.token_ids) == 12
        done[other] = out.finish_time
        t.join(timeout=120)
        assert done[other] < done["m"]  # served while the split model was busy
        assert got == want
        moves = there.stats().moved
        assert any(g == "m" and r == "preempt" and n > 0 for (g, _, r), n in moves.items())
        e.check_integrity()
