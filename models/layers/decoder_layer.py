"""DecoderLayer: the pre-norm block shared by Llama, Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.gated_mlp import GatedMLP
from models.layers.rms_norm import RMSNorm
from models.layers.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). HF names: input_layernorm, self_attn,
    post_attention_layernorm, mlp."""

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
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))
