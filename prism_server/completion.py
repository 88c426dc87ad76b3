"""Completion: a request's output deltas accumulated into its whole result. The one accumulator:
Engine.generate, the HTTP handlers (per choice) and the CLI all fold deltas through it."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import FinishReason, RequestOutput, TokenLogprob


@dataclass
class Completion:
    prompt_token_ids: list[int]
    arrival_time: float  # time.monotonic()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: RequestOutput, now: float) -> None:
        """Fold one delta in; `now` is when it arrived (time.monotonic())."""
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.finish_reason, self.finish_time, self.error = out.finish_reason, now, out.error
