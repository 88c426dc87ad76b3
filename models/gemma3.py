"""Gemma 3 text models (270M .. 27B; the text half of Gemma3ForConditionalGeneration).

Differences from Llama: (1 + w) RMSNorms, four per layer (sandwich around attention and MLP);
embeddings scaled by sqrt(hidden) rounded to the model dtype; q/k norm; scale from
query_pre_attn_scalar; sliding-window layers (config.layer_types) with their own rope base;
GeGLU (gelu tanh) MLP; tied lm_head; optional final logit softcapping.
HF reference: transformers/models/gemma3/modeling_gemma3.py.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.causal_lm import CausalLM
from models.layers.gated_mlp import GatedMLP
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import Rope, RotaryEmbedding
from models.layers.self_attention import SelfAttention


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_sliding = config.layer_types[layer_idx] == "sliding"
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        h = ctx.all_reduce(self.self_attn(self.input_layernorm(x), rope, ctx))
        x = x + self.post_attention_layernorm(h)
        h = ctx.all_reduce(self.mlp(self.pre_feedforward_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_scale = config.hidden_size**0.5
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, config.rope_local_theta)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        # NOTE: HF rounds sqrt(hidden) to the model dtype first (55.4256 -> 55.5 in bf16).
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        rope_full = self.rotary_emb(positions)  # this step's rotary tables
        rope_local = self.rotary_emb_local(positions)
        for layer in self.layers:
            x = layer(x, rope_local if layer.is_sliding else rope_full, ctx)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    family = "gemma3"

    def __init__(self, config: ModelConfig):
        super().__init__(config, Gemma3Model(config))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint; vision weights are skipped."""

    _PREFIXES = (  # checkpoint prefix -> ours (transformers 4 and 5 layouts)
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    _SKIP = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def hf_name(self, name: str) -> str | None:
        if name.startswith(self._SKIP):
            return None
        for old, new in self._PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name
