"""The fp8 command of scripts/bench_engine.py without a GPU: its FLOP count, its floors, its
table and its arguments (the figures themselves need the GPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from models.config import ModelConfig
from models.layers.causal_lm import weight_bytes
from models.loader import meta_model
from models.presets import get_preset
from scripts.bench_engine import (
    FP8_BATCHES,
    decode_floor_ms,
    fp8_rows,
    kv_bytes_a_step,
    main_fp8,
    prefill_flops,
)

LLAMA_8B = ModelConfig.from_hf(get_preset("llama-3.1-8b"))


def test_prefill_flops_count_the_products_not_the_bytes():
    """The speed command counts 2 * (bf16 bytes / 2 - embeddings and LM head) * n: the same
    products (but the norms' weights) as the shape's count, which FP8's bytes do not change."""
    bf16 = weight_bytes(meta_model(LLAMA_8B, torch.bfloat16))
    linear = bf16 // 2 - 2 * LLAMA_8B.vocab_size * LLAMA_8B.hidden_size
    for n in (1024, 8192):
        speed = 2 * linear * n + 2 * LLAMA_8B.hidden_size * LLAMA_8B.vocab_size
        speed += 2 * LLAMA_8B.num_layers * LLAMA_8B.num_heads * LLAMA_8B.head_dim * n * n
        assert prefill_flops(LLAMA_8B, n) == pytest.approx(speed, rel=1e-4)
    # 6.98e9 projection weights: 14.3 TFLOP at 1k tokens, with the attention's 0.27
    assert prefill_flops(LLAMA_8B, 1024) == pytest.approx(14.58e12, rel=1e-3)


def test_the_fp8_floor_is_its_bytes_and_kv_over_the_copy_rate():
    fp8 = weight_bytes(meta_model(LLAMA_8B, torch.bfloat16, "fp8"))  # FP8 bytes, scales, rest
    kv = kv_bytes_a_step(LLAMA_8B, 16, dict(FP8_BATCHES)[16])
    assert kv == 16 * (1024 + 16) * 32 * 2 * 8 * 128 * 2
    assert decode_floor_ms(fp8, 0, 3000.0) == pytest.approx(fp8 / 3e12 * 1e3)
    assert decode_floor_ms(fp8, kv, 3000.0) == pytest.approx(3.76, abs=0.01)  # 11.27 GB at 3 TB/s


def test_the_table_sets_each_side_beside_its_reference():
    def side(tpot_ms: float, weight: int) -> dict:
        return {
            "weight_bytes": weight,
            "activation": {"median_s": 0.5, "floor_s": 0.4},
            "decode_b1": {"tpot_ms": tpot_ms, "floor_ms": 3.0},
            "decode_b16": {"tpot_ms": 2 * tpot_ms, "floor_ms": 4.0},
            "prefill_1024": {"tflops": 500.0},
            "prefill_8192": {"tflops": 600.0},
        }

    results = {
        "ceilings": {"matmul_tflops": 750.0, "fp8_matmul_tflops": 1200.0},
        "sides": {"bf16": side(6.0, 16 << 30), "fp8": side(3.6, 9 << 30)},
    }
    rows = {r[0]: r[1:] for r in fp8_rows(results)}
    assert rows[""] == ("bf16", "fp8")
    assert rows["weights"] == ("16.00 GiB", "9.00 GiB")
    assert rows["activation"][1] == "500 ms (floor 400, x1.25)"
    assert rows["decode B=1 TPOT"] == ("6.00 ms (floor 3.00, x2.00)", "3.60 ms (floor 3.00, x1.20)")
    assert rows["decode B=16 TPOT"][1] == "7.20 ms (floor 4.00, x1.80)"
    # each side's prefill against the matmul rate of its own kind
    assert rows["prefill 1k"] == (
        "500 TFLOP/s, 67% of bf16's 750",
        "500 TFLOP/s, 42% of fp8's 1200",
    )
    results["sides"]["fp8"] = None  # a side that failed
    assert fp8_rows(results)[2][2] == "-"


def test_the_sides_are_checked_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_engine.py fp8", "--sides", "bf16 int4"])
    with pytest.raises(SystemExit):
        main_fp8()
