"""CausalLM: the API every model exposes to the runner (forward, compute_logits, load_weights)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.hf_weights import load_hf_weights


class CausalLM(nn.Module):
    """A decoder stack `model` (with `embed_tokens`) plus `lm_head`, named as in HF checkpoints.

    Subclasses set `family` (ModelConfig.architecture) and build the decoder stack.
    """

    family: str = ""

    def __init__(self, config: ModelConfig, model: nn.Module):
        super().__init__()
        if config.architecture != self.family:
            raise ValueError(
                f"{type(self).__name__} serves {self.family!r}, not {config.architecture!r}"
            )
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 (flat stream of all sequences) -> hidden [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] fp32, final softcapping applied."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hf_name(self, name: str) -> str | None:
        """Checkpoint name -> this model's parameter name (None: not ours, skip)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: (HF parameter name, tensor) pairs, e.g. from safetensors."""
        load_hf_weights(self, weights, self.hf_name)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters, each shared (tied) one counted once; works on meta too."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
