"""Token sampling for one step: greedy fast path; temperature, top-k, top-p, penalties, min_tokens,
per-request seeds, and logprobs (of the model's raw distribution, as vLLM reports them)."""

from __future__ import annotations

import torch

from scheduler.request import Request, TokenLogprob


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._generators[req.request_id] = g
        return g

    def sample(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, vocab] float32, one row per request -> token ids and optional logprobs."""
        if not reqs:  # a step of prefill chunks that all stop short of their prompt's end
            return [], []
        raw = logits
        if any(r.params.needs_penalties or r.num_output_tokens < r.params.min_tokens for r in reqs):
            logits = logits.clone()
            for i, r in enumerate(reqs):
                self._adjust(logits[i], r)
        if all(r.params.greedy for r in reqs):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [self._sample_row(logits[i], r) for i, r in enumerate(reqs)]
        return tokens, self._logprobs(raw, tokens, reqs)

    def _adjust(self, row: torch.Tensor, r: Request) -> None:
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            row[list(banned)] = float("-inf")
        if p.needs_penalties and r.output_token_ids:
            ids, counts = torch.tensor(r.output_token_ids, device=row.device).unique(
                return_counts=True
            )
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty

    def _sample_row(self, row: torch.Tensor, r: Request) -> int:
        p = r.params
        if p.greedy:
            return int(row.argmax())
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
        return int(torch.multinomial(probs, 1, generator=self._generator(r)))

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: list[int], reqs: list[Request]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if not wanted:
            return out
        lp = raw[wanted].log_softmax(-1)
        k = max(reqs[i].params.logprobs for i in wanted)
        top_v, top_i = lp.topk(max(k, 1), dim=-1) if k else (None, None)
        chosen = lp[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])].tolist()
        for j, i in enumerate(wanted):
            n = reqs[i].params.logprobs
            top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else []
            out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return out
