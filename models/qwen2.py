"""Qwen2 / Qwen2.5: Llama with bias on the q/k/v projections (none on o_proj).

HF reference: transformers/models/qwen2/modeling_qwen2.py.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.layers.causal_lm import CausalLM
from models.llama import LlamaModel


class Qwen2ForCausalLM(CausalLM):
    family = "qwen2"

    def __init__(self, config: ModelConfig):
        if not config.attention_bias or config.qk_norm:
            raise ValueError("Qwen2 has q/k/v bias and no q/k norm")
        super().__init__(config, LlamaModel(config))
