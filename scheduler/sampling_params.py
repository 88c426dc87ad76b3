"""Internal sampling parameters (the protocol module converts OpenAI requests into these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None = off; k >= 0 = chosen token plus its top k alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and output
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # lower is served first among requests with equal deadlines (vLLM's)
    # structured output: a compiled grammar (opaque here; the sampler masks the logits with it)
    grammar: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be non-negative (0 disables it), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.grammar is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias: token {tok} bias {bias} (ids >= 0, bias in [-100, 100])"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (bias, penalties;
        min_tokens is per step)."""
        return self.needs_penalties or self.repetition_penalty != 1.0 or bool(self.logit_bias)

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output."""
        return self.grammar is not None

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token id the parameters name (checked against the vocabulary)."""
        return self.stop_token_ids + tuple(t for t, _ in self.logit_bias)
