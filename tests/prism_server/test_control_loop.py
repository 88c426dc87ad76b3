"""The control loop over a real engine: request rates from the snapshots, the KVPR plan, and its
moves as commands (evict an idle model the plan offloads, prefetch a model with demand that left
for room). Rounds are run by hand (`tick`) with the loop's own thread parked."""

from __future__ import annotations

import time

from models.lora.synthetic import write_adapters
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.sampling_params import SamplingParams
from scheduler.snapshot import Residency

PAGE = 64 << 10
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _engine() -> Engine:
    # the same TTFT SLO for both (else each is a multiple of its profiled prefill time, which a
    # loaded machine can skew until the demand of the busier model reads lower)
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i, ttft_slo_ms=1000.0)
        for i, n in enumerate("ab")
    )
    return Engine(
        EngineConfig(
            models=specs,
            device="cpu",
            page_bytes=PAGE,
            pool_budget_bytes=17 * PAGE,  # one model's 9 weight pages and 7 of KV
            plan_interval_s=3600.0,  # the test runs the rounds
        )
    )


def _state(e: Engine, name: str) -> Residency:
    return e.model_snapshot(name).residency


def _settle(e: Engine, name: str, state: Residency) -> None:
    deadline = time.monotonic() + 30
    while _state(e, name) is not state:
        assert time.monotonic() < deadline, (name, _state(e, name))
        time.sleep(0.005)


def test_the_plan_swaps_an_idle_model_for_one_with_demand_before_its_next_request():
    with _engine() as e:
        assert (_state(e, "a"), _state(e, "b")) == (Residency.RESIDENT, Residency.OFFLOADED)
        loop = e.control
        t = time.monotonic()
        loop.tick(t)
        e.generate("a", [[5, 6, 7]] * 6, PARAMS)  # a is in demand
        e.generate("b", [[5, 6, 7]], PARAMS)  # b takes a's place (a evicted for room)
        assert (_state(e, "a"), _state(e, "b")) == (Residency.OFFLOADED, Residency.RESIDENT)
        view = loop.tick(t + 1.0)
        assert view.rates["a"] > view.rates["b"] > 0
        assert view.placement.assignment == {"a": (e.snapshots()[0].device,)}
        assert view.placement.offloaded == ("b",)
        _settle(e, "b", Residency.OFFLOADED)  # the idle b leaves...
        loop.tick(t + 1.1)
        _settle(e, "a", Residency.RESIDENT)  # ...and a comes back with no request for it
        moves = {(mv.giver, mv.reason) for mv in e.snapshots()[0].moves}
        assert ("a", "evict") in moves and ("b", "plan") in moves
        sent = loop.moves_sent
        for k in range(5):  # the same rates: nothing moves again
            loop.tick(t + 1.2 + 0.1 * k)
        assert loop.moves_sent == sent
        assert (_state(e, "a"), _state(e, "b")) == (Residency.RESIDENT, Residency.OFFLOADED)
        e.check_integrity()


def test_a_model_an_admin_evicted_is_not_brought_back_by_the_plan():
    with _engine() as e:
        loop = e.control
        t = time.monotonic()
        loop.tick(t)
        e.generate("a", [[5, 6, 7]] * 4, PARAMS)
        e.evict("a")
        for k in range(3):
            loop.tick(t + 1.0 + 0.1 * k)
        time.sleep(0.05)
        assert _state(e, "a") is Residency.OFFLOADED
        out = e.generate("a", [[5, 6, 7]], PARAMS)[0]  # a request still brings it back
        assert len(out.token_ids) == 4 and _state(e, "a") is Residency.RESIDENT
        e.check_integrity()


def test_the_plan_is_in_metrics_and_baselines_run_no_planner():
    with _engine() as e:
        e.control.tick(time.monotonic())
        assert e.plan_view() is not None and e.plan_view().placement.kvpr
    cfg = EngineConfig(
        models=(ModelSpec("a", "dummy:tiny-llama", block_size=4),),
        device="cpu",
        page_bytes=PAGE,
        policy="static",
    )
    with Engine(cfg) as e:
        assert e.control is None and e.plan_view() is None


def test_the_plan_holds_a_bases_active_adapters_with_its_weights(tmp_path):
    """A base's adapters with work or pages count in its placement's bytes, a page each at
    least (they run only in its steps, on its device); idle ones evicted count for nothing."""
    (a_dir,) = write_adapters(tmp_path, "tiny-llama", ["ft"], rank=4)
    specs = (
        ModelSpec("base", "dummy:tiny-llama", block_size=4),
        ModelSpec("ft", base="base", adapter=str(a_dir)),
    )
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, plan_interval_s=3600.0)
    with Engine(cfg) as e:
        base = e.model_snapshot("base")
        (ft,) = base.adapters
        pages = -(-ft.weight_bytes // PAGE)
        e.generate("ft", [[5, 6, 7]], PARAMS)
        view = e.control.tick(time.monotonic())
        assert e.model_snapshot("base").adapters[0].resident
        assert view.weights == {"base": base.weight_bytes + pages * PAGE}
        w = e.workers[0]
        assert w.call(lambda: w.memory.evict_idle_adapter(None))  # idle: its pages go back
        view = e.control.tick(time.monotonic())
        assert view.weights == {"base": base.weight_bytes}
        e.check_integrity()
