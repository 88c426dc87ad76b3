"""DecoderLayer: the pre-norm block shared by Llama, Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.gated_mlp import GatedMLP
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import Rope
from models.layers.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). HF names: input_layernorm, self_attn,
    post_attention_layernorm, mlp.

    The residual stream is carried beside the layer's output rather than added at its end: each
    add joins the norm after it (RMSNorm.add, one kernel on CUDA), the last one the model's
    final norm."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for the first layer, residual None),
        residual: the stream before it, each [T, hidden] -> (this layer's output, the stream
        before it); the stream after this layer is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = ctx.all_reduce(self.self_attn(h, rope, ctx))
        h, residual = self.post_attention_layernorm.add(h, residual)
        return ctx.all_reduce(self.mlp(h, ctx)), residual
