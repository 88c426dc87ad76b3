"""Preemption for another model's new work, end to end on tiny models: a newcomer that can still
meet its TTFT deadline takes one running request's KV (one victim, once); one already past its
deadline preempts nothing and waits for the pages that running requests give back."""

from __future__ import annotations

import logging
import queue
import re
import time

import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.sampling_params import SamplingParams

PAGE = 64 << 10
WEIGHT_PAGES = 9  # a tiny-llama's weights
KV_PAGES = 4  # room for the running model's requests, not for the newcomer's too


def _engine(newcomer_ttft_ms: float) -> Engine:
    specs = (
        ModelSpec("busy", "dummy:tiny-llama", block_size=4, max_model_len=1024),
        ModelSpec(
            "new",
            "dummy:tiny-llama",
            block_size=4,
            seed=1,
            max_model_len=1024,
            ttft_slo_ms=newcomer_ttft_ms,
            tpot_slo_ms=60_000,
        ),
    )
    return Engine(
        EngineConfig(
            models=specs,
            device="cpu",
            page_bytes=PAGE,
            pool_budget_bytes=(2 * WEIGHT_PAGES + KV_PAGES) * PAGE,
            policy="prism",
        )
    )


def _run(e: Engine, caplog) -> list[str]:
    """Fills the KV with the busy model's long requests, then sends the newcomer's; returns the
    busy model's requests preempted for the newcomer, as logged (every request ends)."""
    caplog.set_level(logging.INFO, logger="prism_server.engine.device_memory")
    done: queue.SimpleQueue = queue.SimpleQueue()
    first: dict[str, float] = {}

    def sink(name: str):
        def on(out):
            if out.new_token_ids and name not in first:
                first[name] = time.monotonic()
            if out.finished:
                assert out.error is None, out.error
                done.put(name)

        return on

    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for k in range(6):
        e.add_request("busy", [10 + (k * 13 + j) % 200 for j in range(200)], long, sink(f"b{k}"))
    deadline = time.monotonic() + 60
    while "b0" not in first:  # the busy model runs and holds the KV
        assert time.monotonic() < deadline
        time.sleep(0.01)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    e.add_request("new", list(range(10, 210)), short, sink("new"))
    for _ in range(7):
        done.get(timeout=300)
    e.check_integrity()
    logged = [
        re.match(r"preempted (\S+) of busy for new's", r.getMessage()) for r in caplog.records
    ]
    return [m.group(1) for m in logged if m]


@pytest.mark.slow
def test_new_work_that_can_meet_its_deadline_preempts_running_requests_once_each(caplog):
    with _engine(newcomer_ttft_ms=60_000) as e:
        victims = _run(e, caplog)
    assert victims and len(set(victims)) == len(victims), victims


@pytest.mark.slow
def test_new_work_past_its_deadline_waits_instead_of_preempting(caplog):
    with _engine(newcomer_ttft_ms=0.001) as e:
        victims = _run(e, caplog)
    assert victims == []
