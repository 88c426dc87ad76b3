"""The default KV budget's inputs that need no GPU: exact weight bytes from a config alone."""

from __future__ import annotations

import torch

from prism_server.config import ModelSpec
from prism_server.memory_budget import default_kv_budget, weight_bytes


def test_weight_bytes_are_the_parameter_bytes_at_the_serving_dtype():
    spec = ModelSpec("m", "dummy:llama-3.1-8b", dtype="bfloat16")
    assert weight_bytes(spec, torch.device("cuda")) == 8_030_261_248 * 2  # Llama-3.1-8B
    tied = ModelSpec("t", "dummy:llama-3.2-1b", dtype="float32")
    assert weight_bytes(tied, torch.device("cpu")) == 1_235_814_400 * 4  # lm_head shares embed


def test_the_host_default_budget_is_fixed():
    assert default_kv_budget(torch.device("cpu")) == 2 << 30
