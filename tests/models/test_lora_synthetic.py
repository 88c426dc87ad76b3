"""The benchmarks' synthetic adapters (`python -m prism_server make-adapters`): every projection
of a dummy base adapted at the asked rank, non-zero, each name its own weights, read back by the
adapter reader against that base; names given as a list or a zero-padded range."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.lora import read_adapter
from models.lora.synthetic import names_arg
from models.presets import get_preset
from models.registry import get_model_class
from prism_server.cli.main import main


def test_names_as_a_list_or_a_range():
    assert names_arg("a,b") == ["a", "b"]
    assert names_arg("ft{008..011},x") == ["ft008", "ft009", "ft010", "ft011", "x"]
    with pytest.raises(ValueError, match="distinct"):
        names_arg("a,a")
    for bad in ("../escape", "a/b", ".."):  # each is a directory of --out, never elsewhere
        with pytest.raises(ValueError, match="not paths"):
            names_arg(bad)
    for bad in ("ft{05..02}", "a{1..}"):
        with pytest.raises(ValueError, match="range"):
            names_arg(bad)


def test_made_adapters_read_back_against_their_base(tmp_path, capsys):
    assert main(["make-adapters", "--preset", "tiny-llama", "--names", "a{0..1}",
                 "--rank", "4", "--out", str(tmp_path)]) == 0  # fmt: skip
    assert "2 adapters of rank 4" in capsys.readouterr().out
    cfg = ModelConfig.from_hf(get_preset("tiny-llama"))
    base = get_model_class(cfg.hf_architecture)(cfg)
    a0, a1 = (read_adapter(tmp_path / n, base) for n in ("a0", "a1"))
    assert a0.rank == a1.rank == 4
    assert set(a0.targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"}  # fmt: skip
    for name, m in a0.weights.modules.items():
        assert m.a.abs().sum() > 0 and all(s.b.abs().sum() > 0 for s in m.shards)
        assert not torch.equal(m.a, a1.weights.modules[name].a)
    # written once: a second call keeps what is there
    before = (tmp_path / "a0" / "adapter_model.safetensors").stat().st_mtime_ns
    assert main(["make-adapters", "--preset", "tiny-llama", "--names", "a0",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    assert (tmp_path / "a0" / "adapter_model.safetensors").stat().st_mtime_ns == before


def test_an_unknown_preset_is_a_clear_error(tmp_path, capsys):
    assert main(["make-adapters", "--preset", "nope", "--names", "a", "--out", str(tmp_path)]) == 2
    assert "no preset 'nope'" in capsys.readouterr().err
