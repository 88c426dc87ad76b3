"""The engine on a GPU: the default KV budget, pages mapped from the engine thread, FlashInfer and
CUDA graphs under the real scheduler, exact accounting at the end."""

from __future__ import annotations

import torch

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine
from prism_server.memory_budget import default_pool_budget, weight_bytes
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


def test_the_l2_prefetches_and_pdl_over_weights_in_the_pool_give_the_same_tokens(monkeypatch):
    """The decode graphs' L2 prefetches (on the side stream, inside the kernels, evict-last) ask
    for weights mapped into the pool's pages, and the step's kernels launch as programmatic
    dependent launches: the engine's tokens are the same engine's without them (the Triton
    norms and activation in both: they round as FlashInfer's do, not bit for bit)."""
    spec = ModelSpec("m", MODEL, max_model_len=1024, max_num_seqs=8)
    prompts = [[300 + (5 * i + j) % 700 for j in range(30 + 50 * i)] for i in range(5)]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = {"PRISM_TRITON_STEP_OPS": "1"}
    warm = plain | {
        "PRISM_TRITON_PDL": "1",
        "PRISM_L2_PREFETCH": "48:12:12",
        "PRISM_L2_PREFETCH_INLINE": "1",
        "PRISM_L2_PREFETCH_KEEP": "1",
    }
    tokens = {}
    for name, env in (("plain", plain), ("warm", warm)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with Engine(EngineConfig(models=(spec,), device="cuda")) as e:
            graphs = e.worker.models["m"].runner.graphs
            assert graphs.step_ops is not None
            assert (graphs.prefetcher is not None) is (name == "warm")
            tokens[name] = [o.token_ids for o in e.generate("m", prompts, greedy)]
            e.check_integrity()
    assert tokens["warm"] == tokens["plain"]
