"""Tensor parallelism over two GPUs of one process: the tiny Llama and Gemma 3 split over
cuda:0 and cuda:1 (NCCL all-reduce, FlashInfer attention over each shard's own paged cache,
launched from one thread) give the whole model's logits on cuda:0, through a prefill and a few
decode steps. Needs two GPUs."""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk, layer_specs
from models.attention.flashinfer_paged import AttentionShape, FlashInferBackend
from models.tensor_parallel import TensorParallel, nccl_all_reduce
from tests.gpu.common import GPU, agreeing_prefix, on_gpu, tiny_model
from tests.gpu.test_piecewise_graphs import GEMMA3

pytestmark = [
    *GPU,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

BLOCK = 16


def _cache(cfg, blocks: int, device) -> list[torch.Tensor]:
    shape = (blocks, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(cfg.num_layers)]


def _attention(model, caches, md, device):
    cfg = model.config
    shape = AttentionShape(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK, torch.bfloat16, torch.bfloat16
    )
    with torch.cuda.device(device):  # FlashInfer plans on the current device's stream
        return FlashInferBackend(shape, layer_specs(model), device)(caches, md)


@torch.no_grad()
def _run(models, devices, prompt: list[int], decode: int) -> torch.Tensor:
    """Prefill then `decode` one-token steps of the same known tokens; the last position's
    logits of every step [1 + decode, vocab]."""
    tp = len(models) > 1
    caches = [_cache(m.config, 32, d) for m, d in zip(models, devices)]
    table = list(range(1, 1 + -(-(len(prompt) + decode) // BLOCK)))
    runner = TensorParallel(models, devices, nccl_all_reduce) if tp else None
    out, done = [], 0
    steps = [len(prompt)] + [1] * decode
    seq = prompt + [(7 * i) % 500 + 3 for i in range(decode)]
    for n in steps:
        ids, pos = seq[done : done + n], list(range(done, done + n))
        ctxs, inputs, positions = [], [], []
        for m, d, c in zip(models, devices, caches):
            md = AttentionMetadata.build([SeqChunk(done, n, table)], BLOCK, d)
            ctxs.append(ForwardContext(attn=_attention(m, c, md, d)))
            inputs.append(torch.tensor(ids, device=d))
            positions.append(torch.tensor(pos, device=d))
        if tp:
            hidden = runner(inputs, positions, ctxs)[0]
            logits = runner.compute_logits(hidden[-1:])
        else:
            hidden = models[0](inputs[0], positions[0], ctxs[0])
            logits = models[0].compute_logits(hidden[-1:])
        out.append(logits.float().cpu())
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("hf", [{}, GEMMA3], ids=["llama", "gemma3"])
def test_two_gpus_give_the_whole_models_logits(hf):
    _, cpu_model = tiny_model(seed=11, **hf)
    whole = on_gpu(cpu_model)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    tp = TensorParallel.split(whole, devices, nccl_all_reduce)
    assert {str(next(s.parameters()).device) for s in tp.shards} == {"cuda:0", "cuda:1"}
    prompt = torch.randint(300, 1000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _run([whole], devices[:1], prompt, 4)
    got = _run(tp.shards, devices, prompt, 4)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 2e-2, float(rel)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_engine_serves_a_model_split_over_two_gpus(tmp_path):
    """tensor_parallel = 2 with devices = 2: the whole model's greedy tokens (bf16: up to a
    near-tie), beside a model on the other GPU, and every page back."""
    import transformers as tf

    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.engine import Engine
    from scheduler.sampling_params import SamplingParams
    from tests.models.test_loader import TINY, _save_hf_dir

    torch.manual_seed(0)  # FlashInfer's head sizes: 64, 128, 256
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "hidden_size": 256, "head_dim": 128}))
    path = _save_hf_dir(tmp_path, hf.eval())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 200, 3, 99], [42, 7, 250, 11, 64, 1, 180, 9]]

    def serve(tp: int, devices: int) -> list[list[int]]:
        specs = (
            ModelSpec("m", str(path), tensor_parallel=tp),
            ModelSpec("other", "dummy:llama-3.2-1b"),
        )
        cfg = EngineConfig(models=specs, device="cuda", devices=devices, kv_budget_bytes=2 << 30)
        with Engine(cfg) as e:
            out = [o.token_ids for o in e.generate("m", prompts, params)]
            assert len(e.generate("other", [[5, 6, 7]], params)[0].token_ids) == 16
            e.check_integrity()
            return out

    whole, split = serve(1, 2), serve(2, 2)
    same = sum(a == b for a, b in zip(whole, split))
    prefix = [agreeing_prefix(a, b) for a, b in zip(whole, split)]
    assert same >= 1 and min(prefix) >= 4, (whole, split)


def test_decode_graphs_on_the_second_gpu_and_after_a_move_give_the_first_gpus_tokens():
    """Two copies of one dummy model, one on each GPU: the same greedy tokens from either (a
    graph captured on the wrong device's stream records nothing and replays stale logits),
    and again once the second copy has moved to the first GPU and back."""
    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.commands import PlanEvict
    from prism_server.engine.engine import Engine
    from scheduler.sampling_params import SamplingParams

    specs = (ModelSpec("a", "dummy:llama-3.2-1b"), ModelSpec("b", "dummy:llama-3.2-1b"))
    cfg = EngineConfig(models=specs, device="cuda", devices=2, kv_budget_bytes=4 << 30)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 200, 3, 99], [42, 7, 250, 11, 64, 1, 180, 9], [8] * 40]

    with Engine(cfg) as e:

        def tokens(name: str) -> list[list[int]]:
            return [o.token_ids for o in e.generate(name, prompts, params)]

        def move_b(dst: str) -> None:
            w = next(w for w in e.workers if w.name == e.model("b").device)
            assert w.execute(PlanEvict("b"))  # offloaded as the plan does: it may move
            assert e.migrate("b", dst) and e.model("b").device == dst

        names = [w.name for w in e.workers]
        home = e.model("a").device
        away = next(n for n in names if n != home)
        ref = tokens("a")
        if e.model("b").device == home:
            move_b(away)
        assert tokens("b") == ref  # on the other GPU
        move_b(home)
        assert tokens("b") == ref  # moved beside "a"
        move_b(away)
        assert tokens("b") == ref  # and back
        e.check_integrity()
