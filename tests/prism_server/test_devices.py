"""Several (emulated) CPU devices in one engine: each its own page pool and engine thread; the
planner spreads the models over them at load, requests run on their model's device, every
device publishes its own snapshot, and the control loop plans over all of them."""

from __future__ import annotations

import time

import pytest
import torch

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine
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
