"""The over-subscribed set-up docs/bench/fleet24: its config loads, its fleet's bf16 weights are
well over the pool, and its workload and SLO file name exactly the config's models. Weights are
sized as start-up sizes them, on the meta device: nothing is allocated and no weight is made."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.loader import ModelSource, read_config
from prism_server.bench.workload import activity, read_csv
from prism_server.config import ModelSpec
from prism_server.engine.memory_budget import weight_bytes
from prism_server.server_args import apply_slo_file, load_server_args

SETUP = Path(__file__).resolve().parents[2] / "docs" / "bench" / "fleet24"
GIB = 1 << 30


@pytest.fixture(scope="module")
def args():
    return load_server_args(str(SETUP / "prism.toml"))


@pytest.fixture(scope="module")
def weights(args) -> dict[str, int]:
    """Model name -> its weights' bytes at bf16 (the GPU's dtype), sized once per source."""
    per_source = {
        s: weight_bytes(ModelSpec(name="sizing", source=s), torch.device("cuda"))
        for s in {m.source for m in args.models}
    }
    return {m.name: per_source[m.source] for m in args.models}


def _command(text: str) -> list[str]:
    """The workload command written in the config's header comment, as arguments."""
    lines = [ln.removeprefix("#").strip() for ln in text.splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if "bench workload" in ln)
    joined = []
    for ln in lines[start:]:
        joined.append(ln.removesuffix("\\"))
        if not ln.endswith("\\"):
            break
    return shlex.split(" ".join(joined))


def test_the_fleet_is_24_models_of_several_architectures_over_the_pool(args, weights):
    models = args.models
    assert len(models) == 24 and len({m.name for m in models}) == 24
    assert len({m.seed for m in models}) == 24  # dummy weights differ from model to model
    archs = Counter(read_config(ModelSource.parse(m.source), None).hf_architecture for m in models)
    assert len(archs) >= 4, archs
    pool = args.engine.pool_budget_bytes
    assert pool == 56 * GIB
    total = sum(weights.values())
    assert total >= 1.5 * pool  # residency must change while the trace runs
    assert total / GIB == pytest.approx(107.3, abs=0.1)  # the header's figure
    assert args.engine.host_budget_bytes >= total  # every model keeps a host copy
    # the order mixes sizes (a capacity sweep adds models in it): no prefix of the fleet holds
    # much more than its share of the bytes, as the four 7-8B models first would
    acc = 0
    for i, m in enumerate(models, start=1):
        acc += weights[m.name]
        assert acc <= 1.5 * total * i / 24 + 16 * GIB, (i, m.name)
    assert max(weights.values()) > 6 * min(weights.values())  # 1B to 8B


def test_the_workload_and_slos_name_exactly_the_configs_models(args):
    names = [m.name for m in args.models]
    rows = read_csv(SETUP / "workload.csv")
    assert len(rows) >= 400
    assert {r.model for r in rows} == set(names)
    assert 60 <= rows[-1].arrival_s <= 120  # a run at x1
    assert all(r.prompt_len <= 4096 and r.output_len <= 256 for r in rows)
    # the header's command made it: its models in config order, its time scale undone gives the
    # activity the header reports, on the trace's own minutes
    cmd = _command((SETUP / "prism.toml").read_text())
    opt = {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--")}
    assert opt["--models"].split(",") == names
    assert opt["--out"] == "docs/bench/fleet24/workload.csv"
    act = activity(rows, names, 60.0, float(opt["--time-scale"]), float(opt["--duration-s"]))
    assert act.windows == 30
    assert round(100 * act.idle_mean) == 67 and round(act.changes_per_hour) == 486
    slo = apply_slo_file(args, str(SETUP / "slos.json"))
    assert {(m.ttft_slo_ms, m.tpot_slo_ms) for m in slo.models} == {(1500.0, 80.0)}
    assert [m.name for m in slo.models] == names


def test_the_fp8_fleet_is_the_same_fleet_in_fp8(args):
    fp8 = load_server_args(str(SETUP / "prism-fp8.toml"))
    assert fp8.engine.pool_budget_bytes == args.engine.pool_budget_bytes
    assert fp8.engine.host_budget_bytes == args.engine.host_budget_bytes
    assert [replace(m, quantization=None) for m in fp8.models] == list(args.models)
    assert {m.quantization for m in fp8.models} == {"fp8"}
    total = sum(weight_bytes(m, torch.device("cuda")) for m in fp8.models)
    assert total / GIB == pytest.approx(62.6, abs=0.1)  # the header's figure, 1.12x the pool
