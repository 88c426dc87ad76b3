"""Piecewise CUDA graphs: prefill steps and mixed steps (a prompt's last chunk beside decodes)
replayed segment by segment, attention eager between them, give the eager tokens and logits; a
step larger than the largest bucket runs eagerly."""

from __future__ import annotations

import pytest
import torch

from models.kernels.tuning import KernelConfig
from prism_server.engine.model_runner import ModelRunner
from tests.gpu.common import (
    GPU,
    assert_logits_close,
    assert_no_real_divergence,
    cuda_pool,
    greedy,
    model_engine,
    on_gpu,
    prompts,
    tiny_model,
)

pytestmark = GPU

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}  # q/k norms in segments
GEMMA3 = {  # sliding and full layers, each with its own rope; a final soft cap
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 96,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    },
    "final_logit_softcapping": 5.0,
}


def count_runs(me) -> list[int]:
    """Counts the steps run through piecewise graphs, and their token counts."""
    sizes: list[int] = []
    run = me.runner.pieces.run

    def counting(input_ids, *a, **k):
        sizes.append(input_ids.shape[0])
        return run(input_ids, *a, **k)

    me.runner.pieces.run = counting
    return sizes


@pytest.mark.parametrize("kv_in_graph", [False, True], ids=["kv-eager", "kv-in-graph"])
@pytest.mark.parametrize("hf", [{}, QWEN3, GEMMA3], ids=["llama", "qwen3", "gemma3"])
def test_prefill_and_mixed_steps_replayed_piecewise_give_the_eager_tokens(hf, kv_in_graph):
    """kv_in_graph: the segments write K/V (from the step's slots), the eager part is attention
    alone."""
    cfg, cpu_model = tiny_model(seed=5, **hf)
    model = on_gpu(cpu_model)
    pool = cuda_pool(pages=8)
    pieces = model_engine("pieces", cfg, model, pool, graphs=True)
    pieces.runner = ModelRunner(model, pieces.kv.cache, pieces.device, piecewise_kv=kv_in_graph)
    eager = model_engine("eager", cfg, model, pool, graphs=False)
    assert pieces.runner.pieces is not None and eager.runner.pieces is None
    assert pieces.runner.pieces.writes_kv is kv_in_graph
    prefill_and_mixed_step_as_eager(pieces, eager, seed=4, logits_bound=1e-2)


def prefill_and_mixed_step_as_eager(pieces, eager, seed: int, logits_bound=None) -> None:
    """6 prompts, 292 tokens under a 256-token step budget: a 256-token prefill step (bucket
    256), then the last prompt's remaining chunk beside five decodes (a mixed step, bucket 64),
    then decodes; the graphed engine's greedy tokens (and logits within logits_bound, relative,
    up to the first divergence) as the eager one's. Closes both."""
    sizes = count_runs(pieces)
    ps = prompts(6, seed=seed)
    ref_tokens, ref_logits = greedy(eager, ps, 12)
    tokens, logits = greedy(pieces, ps, 12)
    same = assert_no_real_divergence(ref_tokens, ref_logits, tokens, tie=0.02)
    assert same >= 3, same
    if logits_bound is not None:
        assert_logits_close(ref_tokens, ref_logits, tokens, logits, logits_bound)
    assert sizes[:2] == [256, sum(map(len, ps)) - 256 + 5], sizes
    for me in (pieces, eager):
        me.check_integrity()
        me.close()
    torch.cuda.synchronize()


def test_fa3_steps_through_the_piecewise_graphs_give_the_eager_tokens():
    """Every prefill and mixed step through fa3 (the default's kernel from 1024 tokens): its
    output straight into the graphs' static buffer (out=), q, k and v put there by the
    segments' rope_write; the eager engine (fa2, graphs off) gives the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    cfg, cpu_model = tiny_model(seed=7)
    model = on_gpu(cpu_model)
    pool = cuda_pool(pages=8)
    fa3 = KernelConfig(prefill_backend="fa3", prefill_backend_min_tokens=0)
    pieces = model_engine("pieces", cfg, model, pool, kernels=fa3)
    eager = model_engine("eager", cfg, model, pool, graphs=False)
    assert pieces.runner.pieces is not None and pieces.runner.pieces.fuses_rope
    assert pieces.runner.attention.prefill_backends == ("fa3",)
    prefill_and_mixed_step_as_eager(pieces, eager, seed=8)


def test_a_step_past_the_largest_bucket_runs_eagerly():
    """Buckets of 8 and 16 tokens: a 5-token prompt replays the 8-token bucket, a 34-token one
    runs eagerly; both give the eager engine's tokens."""
    cfg, cpu_model = tiny_model(seed=6)
    model = on_gpu(cpu_model)
    pool = cuda_pool(pages=8)
    small = model_engine("small", cfg, model, pool)
    small.runner = ModelRunner(model, small.kv.cache, small.device, piecewise_sizes=(8, 16))
    eager = model_engine("eager", cfg, model, pool, graphs=False)
    sizes = count_runs(small)
    for p in prompts(2, seed=9):  # 5 and 34 tokens, one at a time
        ref_tokens, ref_logits = greedy(eager, [p], 4)
        tokens, _ = greedy(small, [p], 4)
        assert_no_real_divergence(ref_tokens, ref_logits, tokens, tie=0.02)
    assert sizes == [5], sizes
    for me in (small, eager):
        me.check_integrity()
        me.close()
