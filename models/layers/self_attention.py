"""SelfAttention: fused qkv projection, optional q/k norm, rope, paged attention, o_proj."""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext, LayerAttention
from models.config import ModelConfig
from models.layers.merged_linear import MergedLinear
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import Rope


class SelfAttention(nn.Module):
    """One decoder layer's attention (HF submodule `self_attn`), for every supported family.

    Reads from the config: qkv/o bias, q/k norm (Gemma's (1 + w) form for gemma3), the softmax
    scale, and whether this layer slides (config.layer_types[layer_idx]).
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = d = config.head_dim
        q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows},
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(q_rows, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:
            gemma = config.architecture == "gemma3"
            self.q_norm = RMSNorm(d, config.rms_norm_eps, unit_offset=gemma)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, unit_offset=gemma)
        else:
            self.q_norm = self.k_norm = None
        sliding = config.layer_types[layer_idx] == "sliding"
        self.spec = LayerAttention(
            scale=config.attn_scale,
            sliding_window=config.sliding_window if sliding else None,
            logit_softcap=config.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        # x: [T, hidden]; rope: this step's rotary table -> [T, hidden]
        return ctx.linear(self.o_proj, self.attend(ctx.linear(self.qkv_proj, x), rope, ctx))

    def attend(self, qkv: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        """The attention between the projections: qkv [T, (Hq + 2 Hkv) D] -> [T, Hq D]."""
        t = qkv.shape[0]
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # rope on q and k, then attention (one kernel for the rope and K/V write where it can)
        out = ctx.attention(self.layer_idx, q, k, v, self.spec, rope)
        return out.reshape(t, q_rows)
