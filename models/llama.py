"""Llama 2/3.x (incl. llama3 rope scaling), SmolLM2 and Mistral (sliding window from the config).

HF reference: transformers/models/llama/modeling_llama.py, mistral/modeling_mistral.py.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.causal_lm import CausalLM
from models.layers.decoder_layer import DecoderLayer
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding


class LlamaModel(nn.Module):
    """Embedding, pre-norm decoder layers, final norm (HF `model.*`). Qwen2/3 reuse it: their
    differences (qkv bias, q/k norm) are config fields read by SelfAttention."""

    # a stack of DecoderLayers under HF's names: small decode graphs may run it through
    # models.kernels.fused_decode
    pre_norm_stack = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, hidden]
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions)  # this step's rotary table, shared by every layer
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        if residual is None:
            return self.norm(x)
        return self.norm.add(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    family = "llama"

    def __init__(self, config: ModelConfig):
        super().__init__(config, LlamaModel(config))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer when config.sliding_window is set (v0.1)."""
