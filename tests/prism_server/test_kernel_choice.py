"""Which FlashInfer kernels attention runs: read from the environment once, when an engine is
built, validated, and handed to every device's shared resources (so every runner's backend)."""

from __future__ import annotations

import pytest

from models.attention.flashinfer_paged import DEFAULT_KERNELS, KernelChoice
from prism_server import envs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine


def test_the_defaults_and_a_bad_backend():
    assert KernelChoice(True, "fa2", ragged_prefill=True) == DEFAULT_KERNELS
    assert KernelChoice(prefill_backend="fa3").prefill_backend == "fa3"
    with pytest.raises(ValueError, match="choose from fa2, fa3, auto"):
        KernelChoice(prefill_backend="fa4")


def test_the_environment_reaches_every_devices_resources(monkeypatch):
    monkeypatch.setenv("PRISM_DECODE_TENSOR_CORES", "0")
    monkeypatch.setenv("PRISM_PREFILL_BACKEND", "fa3")
    monkeypatch.setenv("PRISM_RAGGED_PREFILL", "0")
    assert not envs.decode_tensor_cores() and envs.prefill_backend() == "fa3"
    assert not envs.ragged_prefill()
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, devices=2)) as e:
        kinds = {w.resources.kernels for w in e._workers}
        assert kinds == {KernelChoice(False, "fa3", ragged_prefill=False)}
        e.check_integrity()
    monkeypatch.setenv("PRISM_PREFILL_BACKEND", "fa4")
    with pytest.raises(ValueError, match="fa4"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
