"""The bench on a LoRA fleet (docs/bench/lora100's shape, tiny): a base with synthetic adapters
beside another base, the adapters evicted with their base before the replay. Every request of
the base and its adapters is served; the run's activations count the adapters' own (each came
back for its first request) and the report has a row per adapter."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from models.lora.synthetic import write_adapters
from prism_server.bench.fleet import fleet_of
from prism_server.bench.sweep_run import run_once
from prism_server.bench.workload import Row
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread

ADAPTERS = ("ft0", "ft1", "ft2")


def test_a_replay_over_adapters_counts_their_activations(tmp_path):
    dirs = write_adapters(tmp_path, "tiny-llama", ADAPTERS, rank=4)
    specs = (
        ModelSpec("base", "dummy:tiny-llama", block_size=4),
        ModelSpec("other", "dummy:tiny-llama", block_size=4, seed=1),
        *(ModelSpec(n, base="base", adapter=str(d)) for n, d in zip(ADAPTERS, dirs)),
    )
    engine = Engine(EngineConfig(models=specs, device="cpu", page_bytes=64 << 10, max_loras=2))
    srv = serve_in_thread(engine)
    try:
        engine.evict("base")  # its adapters go with it
        rows = [Row(0.05 * i, m, 8, 5) for i, m in enumerate([*ADAPTERS, "base", "other"] * 2)]
        slos = {r.model: {"ttft_s": 30.0, "tpot_s": 30.0} for r in rows}
        run = asyncio.run(run_once(srv.url, rows, slos, 1.0, 2.0, 0.05))
        with urllib.request.urlopen(srv.url + "/v1/status", timeout=10) as r:
            fleet = fleet_of(json.loads(r.read()))
        engine.check_integrity()
    finally:
        srv.close()
    reqs = run["requests"]
    assert len(reqs) == len(rows) and all(r["error"] is None and r["tokens"] == 5 for r in reqs)
    assert set(run["report"]["models"]) == {*ADAPTERS, "base", "other"}
    # the base and each of its adapters came back once at least
    assert run["activations"] >= 1 + len(ADAPTERS)
    # the fleet as static's subset sizes it: the adapters beside the models, each with its base
    assert set(fleet["models"]) == {"base", "other"}
    assert {a: f["base"] for a, f in fleet["adapters"].items()} == dict.fromkeys(ADAPTERS, "base")
    assert all(f["weight_bytes"] > 0 for f in fleet["adapters"].values())
