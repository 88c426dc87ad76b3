"""Lanes: a device's models spread over several streams; beside the arbitrator's pick, a model
of another lane whose requests are running steps in the same engine step (on a GPU, at once on
its own stream). The tokens are those of one lane, the companion admits no one, and every page
comes back."""

from __future__ import annotations

import queue

import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine
from scheduler.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [3, 4], [8, 8, 8, 8, 8]]


def serve_both(
    lanes: int, monkeypatch, source: str = "dummy:tiny-llama", block_size: int = 4, **engine
) -> tuple[dict, int, dict]:
    """Both models' requests at once; (tokens per request, companion steps, lane per model).
    engine: the EngineConfig's device and memory (a 64 KiB page on the CPU by default)."""
    monkeypatch.setenv("PRISM_DECODE_LANES", str(lanes))
    specs = tuple(ModelSpec(n, source, block_size=block_size, seed=i) for i, n in enumerate("ab"))
    engine = engine or {"device": "cpu", "page_bytes": 64 << 10}
    cfg = EngineConfig(models=specs, plan_interval_s=3600.0, **engine)
    with Engine(cfg) as e:
        done: queue.SimpleQueue = queue.SimpleQueue()
        got: dict[tuple[str, int], list[int]] = {}
        for name in "ab":
            for i, p in enumerate(PROMPTS):
                got[name, i] = []

                def sink(out, key=(name, i)):
                    got[key].extend(out.new_token_ids)
                    if out.error:
                        done.put(out.error)
                    elif out.finished:
                        done.put(None)

                e.add_request(name, p, PARAMS, sink)
        errors = [done.get(timeout=120) for _ in got]
        assert errors == [None] * len(got)
        lanes_of = {n: m.lane for n, m in e.worker.models.items()}
        e.check_integrity()
        return got, e.worker.companion_steps, lanes_of


def test_two_lanes_step_both_models_at_once_and_give_one_lanes_tokens(monkeypatch):
    one, none, lane_one = serve_both(1, monkeypatch)
    two, companions, lane_two = serve_both(2, monkeypatch)
    assert lane_one == {"a": 0, "b": 0} and lane_two == {"a": 0, "b": 1}
    assert none == 0 and companions > 0
    assert two == one and all(len(t) == 24 for t in two.values())


def test_a_bad_lane_count_is_refused(monkeypatch):
    monkeypatch.setenv("PRISM_DECODE_LANES", "0")
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    with pytest.raises(ValueError, match="PRISM_DECODE_LANES must be at least 1"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
