"""Tensor parallelism on the host: a model split over two (emulated) devices, each shard with
its slice of the weights and its own paged KV cache, gives the whole model's logits through
chunked prefill and decode, for every family (q/k norms, qkv bias, tied embeddings, Gemma 3's
sandwich norms, sliding layers and soft cap)."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.registry import get_model_class
from models.tensor_parallel import TensorParallel, host_all_reduce, shard_config
from tests.models.test_parity import (
    BLOCK_SIZE,
    HF_CASES,
    PROMPT_LENS,
    _run_paged,
    _tiny_hf_model,
    make_kv_cache,
    paged_steps,
)

CPU = torch.device("cpu")


@torch.no_grad()
def _run_tp(tp: TensorParallel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """_run_paged's steps through the shards: one KV cache per shard, the same block tables."""
    needed = [math.ceil(len(s) / BLOCK_SIZE) for s in seqs]
    kvs = [make_kv_cache(s.config, sum(needed), BLOCK_SIZE) for s in tp.shards]
    blocks = [kv.allocator.allocate(sum(needed)) for kv in kvs]
    assert all(b == blocks[0] for b in blocks)  # fresh allocators: the same blocks
    g = torch.Generator().manual_seed(3)
    perm = [blocks[0][i] for i in torch.randperm(len(blocks[0]), generator=g).tolist()]
    tables = [perm[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seqs))]

    def run(chunks, ids, pos):
        md = AttentionMetadata.build(chunks, BLOCK_SIZE, CPU)
        ctxs = [ForwardContext(attn=TorchPagedAttention(kv.layer_views, md)) for kv in kvs]
        hidden = tp([ids] * len(kvs), [pos] * len(kvs), ctxs)
        for h in hidden[1:]:
            assert torch.equal(h, hidden[0])  # every shard ends with the same states
        return tp.compute_logits(hidden[0])

    out = paged_steps(seqs, PROMPT_LENS, tables, run)
    for kv, b in zip(kvs, blocks):
        kv.allocator.free(b)
        kv.check_integrity()
        kv.close()
    return out


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_two_shards_give_the_whole_models_logits(name):
    hf = _tiny_hf_model(name)
    config = ModelConfig.from_hf(hf.config)
    whole = get_model_class(config.hf_architecture)(config).eval()
    whole.load_weights(hf.state_dict().items())
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(config.vocab_size, (n + 6,), generator=gen).tolist() for n in PROMPT_LENS]
    ref = _run_paged(whole, config, seqs, PROMPT_LENS)
    tp = TensorParallel.split(whole, [CPU, CPU], host_all_reduce)
    assert tp.shards[0].config.num_kv_heads == config.num_kv_heads // 2
    got = _run_tp(tp, seqs)
    for g, r in zip(got, ref):
        assert (g - r).abs().max() < 1e-4, float((g - r).abs().max())


def test_a_model_that_does_not_split_evenly_is_refused():
    config = ModelConfig.from_hf(_tiny_hf_model("llama3").config)  # 4 heads, 2 KV heads
    assert shard_config(config, 2).num_heads == 2
    with pytest.raises(ValueError, match="cannot split 2 KV heads over 4 devices"):
        shard_config(config, 4)
    with pytest.raises(ValueError, match="one shard per device, two or more"):
        TensorParallel([get_model_class(config.hf_architecture)(config)], [CPU])


def test_shards_loaded_from_a_checkpoint_and_dummy_shards(tmp_path):
    """load_shards: a checkpoint's shards (read whole on the host, sliced) give the whole
    model's logits; a dummy model's shards are built without the whole (its own weights)."""
    from models.loader import load_model, load_shards
    from tests.models.test_loader import _save_hf_dir, _tiny_hf_llama

    path = _save_hf_dir(tmp_path, _tiny_hf_llama(tie=True))
    whole = load_model(str(path))
    got = load_shards(str(path), [CPU, CPU], [None, None])
    assert got.config == whole.config and len(got.shards) == 2
    tp = TensorParallel(got.shards, [CPU, CPU], host_all_reduce)
    seqs = [list(range(3, 3 + n + 6)) for n in PROMPT_LENS]
    ref = _run_paged(whole.model, whole.config, seqs, PROMPT_LENS)
    for g, r in zip(_run_tp(tp, seqs), ref):
        assert (g - r).abs().max() < 1e-4
    dummy = load_shards("dummy:tiny-llama", [CPU, CPU], [None, None], seed=3)
    assert dummy.shards[0].config.num_heads * 2 == dummy.config.num_heads
    w0, w1 = (s.model.layers[0].mlp.down_proj.weight for s in dummy.shards)
    assert not torch.equal(w0, w1)  # each shard its own dummy weights
