"""The LoRA set-up docs/bench/lora100: 100 adapters of one 8B base beside two other bases, and
the baselines' merged models, the most whose host copies fit. Its configs load, its workload
names only served models, the merged workload is the prism workload's rows of the merged models,
the SLO file covers every model, and adapters.args makes exactly the adapters prism.toml names.
Weights are sized on the meta device: nothing is allocated."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from models.lora.synthetic import names_arg
from prism_server.bench.workload import activity, read_csv
from prism_server.config import ModelSpec
from prism_server.engine.memory_budget import weight_bytes
from prism_server.server_args import apply_slo_file, load_server_args

SETUP = Path(__file__).resolve().parents[2] / "docs" / "bench" / "lora100"
GIB = 1 << 30
BASES = ["llama8b", "qwen3-8b", "llama3b"]


def _bytes(source: str) -> int:
    return weight_bytes(ModelSpec(name="sizing", source=source), torch.device("cuda"))


@pytest.fixture(scope="module")
def prism():
    return load_server_args(str(SETUP / "prism.toml"))


@pytest.fixture(scope="module")
def merged():
    return load_server_args(str(SETUP / "merged.toml"))


def test_one_base_has_100_adapters_and_the_merged_side_fits_its_host(prism, merged):
    bases = [m for m in prism.models if not m.is_adapter]
    adapters = [m for m in prism.models if m.is_adapter]
    assert [m.name for m in bases] == BASES
    assert [m.name for m in adapters] == [f"ft{i:03d}" for i in range(100)]
    assert {m.base for m in adapters} == {"llama8b"}
    assert prism.engine.max_loras == 32 and prism.engine.max_lora_rank == 16
    # the merged side: the bases as they are, the five busiest fine-tunes as whole 8B models
    assert [m.name for m in merged.models] == BASES + [f"ft{i:03d}" for i in range(5)]
    same = {m.name: m for m in bases}
    for m in merged.models[:3]:
        assert (m.source, m.seed) == (same[m.name].source, same[m.name].seed)
    assert {m.source for m in merged.models[3:]} == {"dummy:llama-3.1-8b"}
    assert len({m.seed for m in merged.models}) == len(merged.models)
    host = merged.engine.host_budget_bytes
    total = sum(_bytes(m.source) for m in merged.models)
    assert total <= host < total + _bytes("dummy:llama-3.1-8b")  # one more would not fit
    assert (merged.engine.pool_budget_bytes, host) == (
        prism.engine.pool_budget_bytes,
        prism.engine.host_budget_bytes,
    )


def test_the_adapters_args_make_what_the_config_names(prism):
    args = shlex.split((SETUP / "adapters.args").read_text())
    opt = dict(zip(args[::2], args[1::2]))
    assert opt["--preset"] == "llama-3.1-8b" and int(opt["--rank"]) == 16
    made = {f"{opt['--out']}/{n}" for n in names_arg(opt["--names"])}
    assert made == {m.adapter for m in prism.models if m.is_adapter}
    base = next(m for m in prism.models if m.name == "llama8b")
    assert base.source == f"dummy:{opt['--preset']}"


def test_the_workloads_and_slos(prism, merged):
    names = [m.name for m in prism.models]
    rows = read_csv(SETUP / "workload.csv")
    assert len(rows) >= 1000 and {r.model for r in rows} <= set(names)
    assert sum(1 for n in names[3:] if any(r.model == n for r in rows)) >= 70  # adapters sending
    assert 60 <= rows[-1].arrival_s <= 120
    act = activity(rows, names, 60.0, 0.025, 3600.0)
    assert round(100 * act.idle_mean) == 90 and round(act.changes_per_hour) == 851
    keep = {m.name for m in merged.models}
    assert read_csv(SETUP / "workload-merged.csv") == [r for r in rows if r.model in keep]
    for args, file in ((prism, "slos.json"), (merged, "slos-merged.json")):
        slo = apply_slo_file(args, str(SETUP / file))
        assert {(m.ttft_slo_ms, m.tpot_slo_ms) for m in slo.models} == {(1500.0, 80.0)}
