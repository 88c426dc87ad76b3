"""The engine on a GPU: the default KV budget, pages mapped from the engine thread, FlashInfer and
CUDA graphs under the real scheduler, exact accounting at the end."""

from __future__ import annotations

import torch

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.engine.memory_budget import default_pool_budget, weight_bytes
from scheduler.request import FinishReason
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU

pytestmark = GPU
MODEL = "dummy:llama-3.2-3b"  # head_dim 128: the FlashInfer module Llama-3.1-8B uses


def test_engine_with_the_default_budget_serves_and_accounts_exactly():
    spec = ModelSpec("m", MODEL, max_model_len=1024, max_num_seqs=8)
    device = torch.device("cuda")
    free_before, _ = torch.cuda.mem_get_info()
    expected = default_pool_budget(device)  # weights and KV
    assert weight_bytes(spec, device) < expected < free_before
    with Engine(EngineConfig(models=(spec,), device="cuda")) as e:
        pool = e.pool
        assert pool.backend.device.type == "cuda"
        # the pool created every page up front; the weights took theirs from it
        assert abs(pool.capacity + 1 - expected // pool.page_bytes) <= 1
        assert pool.stats().created == pool.capacity
        runner = e.worker.models["m"].runner
        assert type(runner.attention).__name__ == "FlashInferBackend"
        assert runner.graphs is not None
        prompts = [[300 + (7 * i + j) % 500 for j in range(40 + 30 * i)] for i in range(5)]
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = e.generate("m", prompts, greedy)
        assert all(o.finish_reason is FinishReason.LENGTH and len(o.token_ids) == 12 for o in outs)
        e.check_integrity()
        snap = e.model_snapshot("m")  # no request holds a block; the prefix cache keeps some
        assert snap.kv_blocks_held == 0 and snap.kv_blocks_used == snap.kv_blocks_prefix_idle
        # the prefix cache on the GPU: a prompt again finds its blocks (the tokens may differ
        # by bf16 near-ties: the prefill's shape changed; CPU tests compare them exactly)
        again = e.generate("m", prompts[-1:], greedy)[0]
        assert again.num_cached_tokens >= len(prompts[-1]) // 16 * 16 - 16
        assert len(again.token_ids) == 12
        e.check_integrity()
