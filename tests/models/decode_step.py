"""A decode step of the tiny Llama in bf16 on the CPU over a cached prompt: the case the fused
decode programs' tests (GEMVs, small GEMMs) run against the model's own forward."""

from __future__ import annotations

import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.loader import load_model

BLOCK = 4  # tokens a page of tiny_bf16_llama's caches


def tiny_bf16_llama():
    """The tiny Llama in bf16 on the CPU and a paged cache for it: 3 pages of BLOCK tokens a
    layer."""
    lm = load_model("dummy:tiny-llama", dtype=torch.bfloat16)
    cfg = lm.config
    caches = [
        torch.zeros(3, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        for _ in range(cfg.num_layers)
    ]
    return lm, caches


def cached_decode_step(rows: int):
    """The tiny bf16 Llama with a 5-token prompt in its cache, and a decode step of `rows` new
    tokens after it: (lm, caches, the caches as the prompt left them, the step's metadata, ids,
    positions, the model's own output for the step). The step wrote its K/V into caches:
    copy `saved` back before running it again."""
    lm, caches = tiny_bf16_llama()
    cpu = torch.device("cpu")
    md = AttentionMetadata.build([SeqChunk(0, 5, [1, 2])], BLOCK, cpu)
    prompt = torch.tensor([5, 17, 200, 3, 99])
    lm.model(prompt, torch.arange(5), ForwardContext(attn=TorchPagedAttention(caches, md)))
    step = AttentionMetadata.build([SeqChunk(5, rows, [1, 2])], BLOCK, cpu)
    ids, pos = torch.tensor([42, 7, 8][:rows]), torch.arange(5, 5 + rows)
    saved = [c.clone() for c in caches]
    plain = lm.model(ids, pos, ForwardContext(attn=TorchPagedAttention(caches, step)))
    return lm, caches, saved, step, ids, pos, plain
