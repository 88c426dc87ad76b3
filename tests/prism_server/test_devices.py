"""Several (emulated) CPU devices in one engine: each its own page pool and engine thread; the
planner spreads the models over them at load, requests run on their model's device, every
device publishes its own snapshot, and the control loop plans over all of them."""

from __future__ import annotations

import time

import pytest
import torch

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import device_commands
from prism_server.engine.commands import PlanEvict
from prism_server.engine.engine import Engine
from scheduler.sampling_params import SamplingParams

PAGE = 64 << 10
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _engine(devices: int, policy: str = "prism") -> Engine:
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate("abcd")
    )
    return Engine(
        EngineConfig(
            models=specs,
            device="cpu",
            devices=devices,
            page_bytes=PAGE,
            pool_budget_bytes=(2 * 9 + 12 + 1) * PAGE,  # two models' weights and 12 KV pages
            policy=policy,
            plan_interval_s=3600.0,
        )
    )


def test_models_spread_over_the_devices_and_serve_there():
    with _engine(2) as e:
        assert [w.name for w in e.workers] == ["cpu:0", "cpu:1"]
        where = {n: s.device for n, s in e.served.items()}
        assert sorted(where.values()) == ["cpu:0", "cpu:0", "cpu:1", "cpu:1"], where
        for snap in e.snapshots():  # each device: its own pool, its own two models resident
            assert {m.name for m in snap.models} == {
                n for n, d in where.items() if d == snap.device
            }
            assert all(m.residency.on_device for m in snap.models)
        with Engine(
            EngineConfig(
                models=(ModelSpec("x", "dummy:tiny-llama", block_size=4),),
                device="cpu",
                page_bytes=PAGE,
            )
        ) as one:
            alone = one.generate("x", [[5, 6, 7]], PARAMS)[0].token_ids
        outs = {n: e.generate(n, [[5, 6, 7]] * 3, PARAMS) for n in "abcd"}
        assert all(len(o.token_ids) == 8 for v in outs.values() for o in v)
        assert [o.token_ids for o in outs["a"]] == [alone] * 3  # seed 0, like x
        view = e.control.tick(time.monotonic())
        assert set(view.placement.kvpr) == {"cpu:0", "cpu:1"}
        assert {d for spot in view.placement.assignment.values() for d in spot} == {
            "cpu:0",
            "cpu:1",
        }
        e.check_integrity()


@pytest.mark.parametrize("policy", ["static", "swap"])
def test_the_baselines_run_on_every_device(policy):
    with _engine(2, policy) as e:
        for n in "abcd":
            assert len(e.generate(n, [[5, 6, 7]], PARAMS)[0].token_ids) == 8
        assert {s.policy for s in e.snapshots()} == {policy}
        e.check_integrity()


@pytest.mark.parametrize("extra", [1, 2])
def test_more_gpus_than_the_machine_has_are_refused(extra):
    have = torch.cuda.device_count()
    n = have + extra
    with pytest.raises(ValueError, match=f"devices = {n}, but this machine has {have} CUDA"):
        Engine(EngineConfig(models=(), device="cuda", devices=n))


def _device_of(e: Engine, name: str):
    return next(w for w in e.workers if w.name == e.served[name].device)


def _offload_for_room(e: Engine, name: str) -> None:
    """Evict a model as the plan does (it may then move; an admin's eviction keeps it home)."""
    w = _device_of(e, name)
    assert w.execute(PlanEvict(name))


def _other(e: Engine, name: str) -> str:
    return next(w.name for w in e.workers if w.name != e.served[name].device)


def test_an_offloaded_model_moves_to_another_device_and_serves_the_same_tokens_there():
    with _engine(2) as e:
        before = e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids
        src, dst = e.served["a"].device, _other(e, "a")
        requests = e.model_snapshot("a").requests_total
        _offload_for_room(e, "a")
        activations = e.model_snapshot("a").activations
        assert e.migrate("a", dst)
        assert e.model_snapshot("a").activations == activations + 1  # its weights came in
        assert e.served["a"].device == dst
        where = {s.device: {m.name for m in s.models} for s in e.snapshots()}
        assert "a" in where[dst] and "a" not in where[src]
        snap = e.model_snapshot("a")
        assert snap.residency.on_device and snap.requests_total == requests  # its history kept
        assert e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids == before
        assert not e.migrate("a", dst)  # already there
        e.check_integrity()


def test_requests_sent_while_a_model_moves_wait_and_are_served_on_its_new_device(monkeypatch):
    with _engine(2) as e:
        before = e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids
        _offload_for_room(e, "a")
        got: list = []
        build = device_commands.build_worker

        def with_a_request(spec, dev, *args, **kw):
            e.add_request("a", [5, 6, 7], PARAMS, got.append)  # held: the model is moving
            return build(spec, dev, *args, **kw)

        monkeypatch.setattr(device_commands, "build_worker", with_a_request)
        assert e.migrate("a", _other(e, "a"))
        deadline = time.monotonic() + 30
        while not (got and got[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got[-1].finished and got[-1].error is None
        assert [t for o in got for t in o.new_token_ids] == before
        e.check_integrity()


def test_a_model_that_cannot_move_now_stays_where_it_is():
    with _engine(2) as e:
        dst = _other(e, "a")
        assert not e.migrate("a", dst)  # resident
        w = _device_of(e, "a")
        e.evict("a")  # by an admin: it stays home
        assert not e.migrate("a", dst)
        assert not e.migrate("a", "cpu:9")
        e.activate("a")
        assert e.served["a"].device == w.name
        assert len(e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids) == 8
        e.check_integrity()


def test_a_model_whose_build_fails_on_the_new_device_is_rebuilt_where_it_was(monkeypatch):
    with _engine(2) as e:
        before = e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids
        src, dst = e.served["a"].device, _other(e, "a")
        _offload_for_room(e, "a")
        build = device_commands.build_worker

        def failing_there(spec, dev, *args, **kw):
            if dev.name == dst:
                raise RuntimeError("no luck on that device")
            return build(spec, dev, *args, **kw)

        monkeypatch.setattr(device_commands, "build_worker", failing_there)
        assert not e.migrate("a", dst)
        assert e.served["a"].device == src and not e.served["a"].failed
        assert e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids == before
        e.check_integrity()


def test_the_control_loop_moves_a_model_with_demand_to_the_device_the_plan_places_it_on():
    """a and c (both with traffic) share a device while the other device's models are idle and
    offloaded: once a is offloaded for room, the plan spreads the demand and a moves over."""
    with _engine(2) as e:
        assert e.served["a"].device == e.served["c"].device
        before = e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids
        for _ in range(3):
            e.generate("a", [[5, 6, 7]], PARAMS)
            e.generate("c", [[5, 6, 7]], PARAMS)
        home = e.served["a"].device
        for n in "bda":
            _offload_for_room(e, n)
        view = e.control.tick(time.monotonic())
        assert view.placement.assignment["a"] != (home,)
        assert e.control.migrations == 1 and e.served["a"].device != home
        assert e.generate("a", [[5, 6, 7]], PARAMS)[0].token_ids == before
        e.check_integrity()
