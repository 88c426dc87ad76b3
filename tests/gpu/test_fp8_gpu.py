"""FP8 weights on a GPU: the layer's matmul against the dequantized weight, and an FP8 model
served by the engine (CUDA graphs, the fused decode programs leaving its layers alone) with half
the weight bytes, the same tokens after an eviction and an activation, exact accounting."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.layers.fp8_linear import fp8_linear
from models.quantization import dequantize_fp8, quantize_fp8
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.request import FinishReason
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU

pytestmark = GPU
MODEL = "dummy:llama-3.2-1b"  # head_dim 64: a FlashInfer module the carried set holds


def test_the_fp8_matmul_is_the_dequantized_weights_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 2048, device="cuda", generator=g, dtype=torch.float32)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.device.type == "cuda"
    for rows in (1, 16, 300):
        x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
        want = F.linear(x.float(), dequantize_fp8(q, scale, torch.float32))
        got = fp8_linear(x, q, scale, None)
        assert got.dtype == torch.bfloat16
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (rows, err.item())


def test_an_fp8_model_serves_with_graphs_and_half_the_weight_bytes():
    bf16 = ModelSpec("b", MODEL, max_model_len=1024, max_num_seqs=8, seed=3)
    fp8 = ModelSpec("f", MODEL, max_model_len=1024, max_num_seqs=8, seed=3, quantization="fp8")
    prompts = [[300 + (7 * i + j) % 500 for j in range(40 + 30 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(EngineConfig(models=(bf16, fp8), device="cuda")) as e:
        assert e.worker.models["f"].runner.graphs is not None
        sizes = {m: e.model_snapshot(m).weight_bytes for m in "bf"}
        assert sizes["f"] < 0.7 * sizes["b"], sizes
        first = e.generate("f", prompts, greedy)
        assert all(o.finish_reason is FinishReason.LENGTH for o in first)
        e.evict("f")
        e.activate("f")
        again = e.generate("f", prompts, greedy)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        e.check_integrity()
