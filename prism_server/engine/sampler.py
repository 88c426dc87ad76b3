"""Token sampling for one step: greedy fast path; logit bias, min_tokens, repetition / frequency /
presence penalties (batched over the rows that need them), structured output (a grammar's token
bitmask), temperature, min-p, top-k, top-p, per-request seeds, and logprobs (of the model's raw
distribution, as vLLM reports them).

Random rows without a seed are sampled together: temperature and min-p batched in torch, then on
CUDA FlashInfer's top-k/top-p kernel (rejection sampling from the logits, no sort), elsewhere the
same filters batched in torch. A row with a seed draws from its request's own generator, one row
at a time, so that its tokens do not depend on what else shares the step."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from models.attention.upload import tensor_on
from prism_server.grammar import Guides
from scheduler.request import Request, TokenLogprob


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self.guides = Guides()
        self.completed: set[str] = set()  # requests whose grammar the last sample completed

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.guides.forget(request_id)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._generators[req.request_id] = g
        return g

    @staticmethod
    def needs_host(req: Request) -> bool:
        """Whether sampling req's next token needs the host to know its last token first: a
        grammar's state advances on the host, token by token."""
        return req.params.constrained

    def launch(
        self, logits: torch.Tensor, reqs: list[Request], unread: torch.Tensor | None = None
    ) -> Sampled:
        """The tokens (and the logprobs asked for) of requests that need nothing of the host
        (`needs_host` false), left on logits' device, launched without waiting for it. unread:
        each row's last output token, sampled on the device and not read yet ([N] int64, or
        None): min_tokens counts it and the penalties see it, as `sample` would once read."""
        self.completed = set()
        tokens = self._draw(logits, reqs, unread)
        return Sampled(tokens, _logprob_tensors(logits, tokens, reqs))

    def sample(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, vocab] float32, one row per request -> token ids and optional logprobs."""
        self.completed = set()
        if not reqs:  # a step of prefill chunks that all stop short of their prompt's end
            return [], []
        got = self._draw(logits, reqs)
        lps = _logprob_tensors(logits, got, reqs)
        tokens = got.tolist()
        if any(r.params.constrained for r in reqs):
            self.completed = self.guides.accept(reqs, tokens)
        return tokens, logprob_list(tokens, reqs, lps and [t.tolist() for t in lps])

    def _draw(
        self, logits: torch.Tensor, reqs: list[Request], unread: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's token, on the device: logit bias, min_tokens' ban and the penalties
        (counting `unread`), grammar masks, then greedy or sampled (logits stay as they are)."""
        pending = 0 if unread is None else 1
        adjust = [
            (i, r)
            for i, r in enumerate(reqs)
            if r.params.adjusts_logits or r.num_output_tokens + pending < r.params.min_tokens
        ]
        constrained = any(r.params.constrained for r in reqs)
        if adjust or constrained:
            logits = logits.clone()
        if adjust:
            _adjust(logits, adjust, unread)
        if constrained:
            self.guides.mask(logits, reqs)
        if all(r.params.greedy for r in reqs):
            return logits.argmax(dim=-1)
        return self._sample_mixed(logits, reqs)

    def _sample_mixed(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Greedy rows by one argmax, unseeded random rows by one batched draw, seeded rows one
        by one from their own generators; on the device, nothing waits for it."""
        dev = logits.device
        out = torch.empty(len(reqs), dtype=torch.long, device=dev)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        batched = [i for i, r in enumerate(reqs) if not r.params.greedy and r.params.seed is None]
        if greedy:
            idx = tensor_on(greedy, torch.long, dev)
            out[idx] = logits[idx].argmax(dim=-1)
        if batched:
            idx = tensor_on(batched, torch.long, dev)
            out[idx] = sample_batch(logits[idx], [reqs[i].params for i in batched])
        for i, r in enumerate(reqs):
            if not r.params.greedy and r.params.seed is not None:
                out[i] = self._sample_row(logits[i], r)
        return out

    def _sample_row(self, row: torch.Tensor, r: Request) -> torch.Tensor:
        """One random token of a seeded request, from its own generator: a 0-d tensor."""
        p = r.params
        row = row / p.temperature
        if p.min_p > 0:
            # p(t) < min_p * p_max  <=>  logit(t) < logit_max + log(min_p)
            row = row.masked_fill(row < row.max() + math.log(p.min_p), float("-inf"))
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self._generator(r))[0]


@dataclass
class Sampled:
    """A step's sampled tokens left on the device: [N] int64, and for the rows that asked for
    logprobs (in row order) their token's logprob and the top k (k: the most any asked for):
    (rows [n], chosen [n], top values [n, k], top ids [n, k]), or None."""

    tokens: torch.Tensor
    logprobs: tuple[torch.Tensor, ...] | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, *(self.logprobs or ())]


def _logprob_tensors(
    raw: torch.Tensor, tokens: torch.Tensor, reqs: list[Request]
) -> tuple[torch.Tensor, ...] | None:
    """The logprobs of the model's raw distribution (vLLM's) for the rows that want them, on
    the device: (rows, chosen, top values, top ids), or None when no row wants any."""
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not wanted:
        return None
    rows = tensor_on(wanted, torch.long, raw.device)
    lp = raw[rows].log_softmax(-1)
    chosen = lp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)
    k = max(reqs[i].params.logprobs for i in wanted)
    top_v, top_i = lp.topk(max(k, 1), dim=-1)
    return rows, chosen, top_v, top_i


def logprob_list(
    tokens: list[int], reqs: list[Request], lps: list[list] | None
) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob (None where none was asked), from `_logprob_tensors`' lists."""
    out: list[TokenLogprob | None] = [None] * len(reqs)
    if lps is None:
        return out
    rows, chosen, top_v, top_i = lps
    for j, i in enumerate(rows):
        n = reqs[i].params.logprobs
        top = list(zip(top_i[j][:n], top_v[j][:n])) if n else []
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out


@functools.cache
def _flashinfer_sampling():
    try:
        from flashinfer import sampling

        return sampling
    except ImportError:
        return None


def sample_batch(logits: torch.Tensor, params: list, use_kernel: bool = True) -> torch.Tensor:
    """One token per row of logits [n, vocab] (float32) under each row's SamplingParams
    (temperature > 0; its seed unused), the filters in the per-row order: temperature, min-p,
    top-k, then top-p of what is left. On CUDA (use_kernel) top-k/top-p run in FlashInfer's
    kernel. -> [n] int64, on logits' device."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = tensor_on([p.temperature for p in params], logits.dtype, dev)
    x = logits / temps[:, None]
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):  # min_p = 0: the threshold is -inf, nothing dropped
        logs = tensor_on([math.log(m) if m > 0 else -math.inf for m in min_p], torch.float32, dev)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + logs[:, None], float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    fi = _flashinfer_sampling() if use_kernel and logits.is_cuda else None
    if fi is not None:
        k = tensor_on(top_k, torch.int32, dev)
        p = tensor_on(top_p, torch.float32, dev)
        return fi.top_k_top_p_sampling_from_logits(x, k, p, deterministic=True).long()
    if any(k < vocab for k in top_k):
        kth = x.topk(max(top_k), dim=-1).values  # [n, max k], descending
        rows = torch.arange(len(params), device=dev)
        cut = kth[rows, torch.tensor(top_k, device=dev) - 1]
        x = x.masked_fill(x < cut[:, None], float("-inf"))
    probs = x.softmax(dim=-1)
    if any(p < 1.0 for p in top_p):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        drop = cum - sorted_p > torch.tensor(top_p, device=dev)[:, None]
        probs = probs.scatter(1, idx, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1).squeeze(1)


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Row i's logprob of targets[i] and its top k alternatives (a prompt's logprobs)."""
    lp = logits.float().log_softmax(-1)
    rows = torch.arange(len(targets), device=lp.device)
    chosen = lp[rows, torch.tensor(targets, device=lp.device)].tolist()
    if not k:
        return [TokenLogprob(t, v, []) for t, v in zip(targets, chosen)]
    top_v, top_i = lp.topk(k, dim=-1)
    return [
        TokenLogprob(t, v, list(zip(ids, vals)))
        for t, v, ids, vals in zip(targets, chosen, top_i.tolist(), top_v.tolist())
    ]


def _token_matrix(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """[len(rows), longest] int64, padded with `pad` (a column past the vocabulary)."""
    width = max(map(len, rows), default=0)
    return tensor_on([r + [pad] * (width - len(r)) for r in rows], torch.long, device)


def _adjust(
    logits: torch.Tensor, rows: list[tuple[int, Request]], unread: torch.Tensor | None = None
) -> None:
    """In place, batched over the rows that need it (vLLM's order): logit bias, min_tokens' ban
    on stop tokens, then repetition, frequency and presence penalties. unread: each logits
    row's output token not read yet ([N] on the device, or None), counted with the others."""
    dev, vocab = logits.device, logits.shape[-1]
    pending = 0 if unread is None else 1
    where, cols, vals = [], [], []
    for i, r in rows:
        p = r.params
        for tok, bias in p.logit_bias:
            where.append(i), cols.append(tok), vals.append(bias)
    if where:
        idx = (tensor_on(where, torch.long, dev), tensor_on(cols, torch.long, dev))
        logits.index_put_(idx, tensor_on(vals, logits.dtype, dev), accumulate=True)
    where, cols = [], []
    for i, r in rows:
        p = r.params
        if r.num_output_tokens + pending < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            where.extend([i] * len(banned)), cols.extend(banned)
    if where:
        logits[tensor_on(where, torch.long, dev), tensor_on(cols, torch.long, dev)] = float("-inf")
    rep = [(i, r) for i, r in rows if r.params.repetition_penalty != 1.0]
    if rep:  # vLLM's rule: over prompt and output, positive logits divided, negative multiplied
        idx = tensor_on([i for i, _ in rep], torch.long, dev)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        known = [r.all_token_ids[: r.num_prompt_tokens + r.num_output_tokens] for _, r in rep]
        seen.scatter_(1, _token_matrix(known, vocab, dev), True)
        if unread is not None:
            seen[torch.arange(len(rep), device=dev), unread[idx]] = True
        pen = tensor_on([r.params.repetition_penalty for _, r in rep], torch.float32, dev)[:, None]
        sub = logits[idx]
        hit = torch.where(sub > 0, sub / pen, sub * pen)
        logits[idx] = torch.where(seen[:, :vocab], hit, sub)
    pens = [(i, r) for i, r in rows if r.params.needs_penalties and (r.output_token_ids or pending)]
    if pens:
        idx = tensor_on([i for i, _ in pens], torch.long, dev)
        ids = _token_matrix([list(r.output_token_ids) for _, r in pens], vocab, dev)
        counts = torch.zeros(len(pens), vocab + 1, device=dev, dtype=logits.dtype)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        if unread is not None:
            counts[torch.arange(len(pens), device=dev), unread[idx]] += 1
        counts = counts[:, :vocab]
        freq = tensor_on([r.params.frequency_penalty for _, r in pens], logits.dtype, dev)[:, None]
        pres = tensor_on([r.params.presence_penalty for _, r in pens], logits.dtype, dev)[:, None]
        logits[idx] -= freq * counts + pres * (counts > 0)
