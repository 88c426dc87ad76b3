"""The kernels' settings as data: default.json, the GPU's own table, the lab's override
(PRISM_KERNEL_CONFIG), read once when an engine is built, validated, and handed to every
device's shared resources (so every runner's backend)."""

from __future__ import annotations

import json

import pytest

from models.kernels import tuning
from models.kernels.triton_gemv import GemvConfig
from models.kernels.triton_small_gemm import SmallGemmConfig
from models.kernels.tuning import CONFIGS, FIELDS, KernelConfig, load_kernel_config, table_name
from prism_server import envs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine

SPEC = ModelSpec("a", "dummy:tiny-llama", block_size=4)


def _override(tmp_path, settings: dict, run: bool = False):
    table = {k: {"value": v, **({"run": "a test"} if run else {})} for k, v in settings.items()}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(table))
    return path


def test_default_json_holds_every_setting_at_the_dataclass_defaults():
    table = json.loads((CONFIGS / "default.json").read_text())
    assert sorted(table) == sorted(FIELDS)
    assert all(isinstance(e["run"], str) and "BENCHMARKS" in e["run"] for e in table.values())
    k = load_kernel_config("")
    assert k == KernelConfig() == load_kernel_config("cpu")
    assert (k.prefill_backend, k.prefill_backend_min_tokens) == ("auto", 1024)
    assert (k.decode_backend_max_batch, k.triton_max_splits, k.triton_stages) == (16, 16, 3)
    assert (k.triton_waves, k.triton_warps, k.triton_dense) == (2, 4, (2, 2))
    assert k.gemv == GemvConfig(2, 2048, 4, 2) and k.small_gemm == SmallGemmConfig()
    assert k.piecewise_max_tokens == 1024
    assert k.fp8_scaled_mm_min_rows == 1  # _scaled_mm for every FP8 step outside the GEMVs
    assert not k.fp8_small_gemm  # an FP8 model's small steps: _scaled_mm, not the small GEMMs
    # the chosen backend from 1024 query tokens a step; fa2 below
    assert [k.prefill_backend_for(n) for n in (1, 1023, 1024)] == ["fa2", "fa2", "auto"]


def test_each_gpu_table_holds_only_its_differences_with_their_runs():
    assert table_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert table_name("NVIDIA H200") == "NVIDIA_H200.json"
    default = json.loads((CONFIGS / "default.json").read_text())
    for path in CONFIGS.glob("*.json"):
        table = json.loads(path.read_text())
        tuning.read_table(path)  # valid, every entry with its run
        if path.name != "default.json":
            assert all(table[k]["value"] != default[k]["value"] for k in table), path.name
    # the small GEMMs measured slower than cuBLAS on the H200, faster on the H100
    assert load_kernel_config("NVIDIA H200") == KernelConfig(small_gemm=None)
    assert load_kernel_config("NVIDIA H100 80GB HBM3") == KernelConfig()
    assert load_kernel_config("NVIDIA A100-SXM4-80GB") == KernelConfig()  # no table: defaults


def test_an_override_goes_over_the_gpus_table(tmp_path):
    path = _override(
        tmp_path,
        {
            "prefill_backend": "fa3",
            "decode_backend_max_batch": 64,
            "triton_dense": None,
            "gemv": [16, 256],
            "small_gemm": "16:64/32:128",
            "piecewise_max_tokens": 2048,
            "fp8_scaled_mm_min_rows": None,
        },
    )
    k = load_kernel_config("NVIDIA H200", path)
    assert (k.prefill_backend, k.decode_backend_max_batch, k.triton_dense) == ("fa3", 64, None)
    assert k.gemv == GemvConfig(16, 256) and k.piecewise_max_tokens == 2048
    assert k.fp8_scaled_mm_min_rows is None  # null: FP8 steps keep the dequantized weight
    assert k.small_gemm == SmallGemmConfig(16, 64, wide=SmallGemmConfig(32, 128))
    k = load_kernel_config("NVIDIA H200", _override(tmp_path, {"gemv": [2, 2048, 4, 4, 1]}))
    assert k.gemv == GemvConfig(2, 2048, 4, 4, one_pass=True)  # the norm read in one pass
    # the run may be named in an override too; unnamed settings keep the GPU's
    k = load_kernel_config("NVIDIA H200", _override(tmp_path, {"triton_stages": 1}, run=True))
    assert k == KernelConfig(small_gemm=None, triton_stages=1)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"triton_splits": 8}, "unknown setting 'triton_splits'"),
        ({"prefill_backend": "fa4"}, "prefill_backend: 'fa4', want fa2 or fa3 or auto"),
        ({"prefill_backend_min_tokens": -1}, "prefill_backend_min_tokens: -1"),
        ({"decode_backend_max_batch": "16"}, "decode_backend_max_batch: '16'"),
        ({"triton_max_splits": 65}, "triton_max_splits: 65, want an integer from 1 to 64"),
        ({"triton_stages": 0}, "triton_stages: 0"),
        ({"triton_waves": 1.5}, "triton_waves: 1.5"),
        ({"triton_warps": 3}, "triton_warps: 3, want 1, 2, 4 or 8"),
        ({"triton_dense": [3, 2]}, r"triton_dense: \(3, 2\)"),
        ({"triton_dense": "2:2"}, "triton_dense: '2:2'"),
        ({"gemv": [12, 256]}, "gemv: GEMV block_n 12: a power of 2"),
        ({"gemv": "2:2048"}, "gemv: '2:2048'"),
        ({"gemv": [2, 2048, 4, 2, 2]}, "gemv: GEMV one_pass 2: 0 or 1"),
        ({"small_gemm": "8:64"}, "small_gemm: small GEMM block_n 8"),
        ({"small_gemm": "16:64/"}, "small_gemm: small GEMM config '16:64/'"),
        ({"small_gemm": 1}, "small_gemm: 1"),
        ({"piecewise_max_tokens": 4}, "piecewise_max_tokens: 4, want an integer >= 8"),
        ({"fp8_scaled_mm_min_rows": 0}, "fp8_scaled_mm_min_rows: 0, want an integer >= 1"),
        ({"fp8_scaled_mm_min_rows": True}, "fp8_scaled_mm_min_rows: True"),
        ({"fp8_small_gemm": 1}, "fp8_small_gemm: 1, want true or false"),
    ],
)
def test_a_bad_setting_is_refused_with_its_name(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        load_kernel_config("", _override(tmp_path, settings))


def test_a_table_of_the_wrong_form_is_refused(tmp_path):
    path = tmp_path / "k.json"
    for text, match in (
        ('{"gemv": [2, 2048]}', 'gemv: want {"value"'),
        ('{"gemv": {"value": null, "why": "x"}}', 'gemv: want {"value"'),
        ("[1, 2]", "one JSON object"),
        ("{", "not valid JSON"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_kernel_config("", path)
    with pytest.raises(ValueError, match="run"):  # a GPU's table names the run of each entry
        tuning.read_table(_override(tmp_path, {"gemv": None}))
    with pytest.raises(ValueError, match="triton_warps: 3"):
        KernelConfig(triton_warps=3)


def test_the_override_reaches_every_device_and_a_bad_one_stops_the_engine(tmp_path, monkeypatch):
    """PRISM_KERNEL_CONFIG is read when an engine is built; its settings reach the device's
    resources: the kernels and the piecewise buckets; an engine built with small GEMMs checks
    the kernel and runs."""
    from prism_server.engine.piecewise_graphs import DEFAULT_TOKEN_BUCKETS, token_buckets

    assert DEFAULT_TOKEN_BUCKETS == (8, 16, 32, 64, 128, 256, 512, 768, 1024)
    assert token_buckets(2048) == (8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert token_buckets(1000) == (8, 16, 32, 64, 128, 256, 512, 768, 1000)
    assert token_buckets(100) == (8, 16, 32, 64, 100) and token_buckets(4) == ()
    assert envs.kernel_config_override() is None
    with Engine(EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.kernels == KernelConfig()
        assert e.worker.resources.piecewise_buckets == DEFAULT_TOKEN_BUCKETS
        e.check_integrity()
    settings = {"piecewise_max_tokens": 2048, "small_gemm": "16:64/32:128", "gemv": [16, 256]}
    monkeypatch.setenv("PRISM_KERNEL_CONFIG", str(_override(tmp_path, settings)))
    with Engine(EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10)) as e:
        k = e.worker.resources.kernels
        assert k.small_gemm == SmallGemmConfig(16, 64, wide=SmallGemmConfig(32, 128))
        assert k.gemv == GemvConfig(16, 256)
        assert e.worker.resources.piecewise_buckets == token_buckets(2048)
        e.check_integrity()
    monkeypatch.setenv("PRISM_KERNEL_CONFIG", str(_override(tmp_path, {"triton_warps": 3})))
    with pytest.raises(ValueError, match="triton_warps: 3"):
        Engine(EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10))
    monkeypatch.setenv("PRISM_KERNEL_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError):
        Engine(EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10))


def test_enforce_eager_turns_off_graphs_and_launch_ahead():
    """enforce_eager: no piecewise graphs, no decode graphs, no step launched ahead."""
    config = EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10, enforce_eager=True)
    with Engine(config) as e:
        res = e.worker.resources
        assert res.enforce_eager and not res.launch_ahead and res.piecewise_buckets == ()
        e.check_integrity()
    with Engine(EngineConfig(models=(SPEC,), device="cpu", page_bytes=64 << 10)) as e:
        assert not e.worker.resources.enforce_eager
        e.check_integrity()
