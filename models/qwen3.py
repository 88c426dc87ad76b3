"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rope; no qkv bias by default.

HF reference: transformers/models/qwen3/modeling_qwen3.py.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.layers.causal_lm import CausalLM
from models.llama import LlamaModel


class Qwen3ForCausalLM(CausalLM):
    family = "qwen3"

    def __init__(self, config: ModelConfig):
        if not config.qk_norm:
            raise ValueError("Qwen3 normalizes q and k per head")
        super().__init__(config, LlamaModel(config))
