from __future__ import annotations

import math

import torch

from prism_server.sampler import Sampler
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams


def req(name: str, **kw) -> Request:
    return Request(
        name, [1, 2, 3], SamplingParams(**kw), eos_token_ids=frozenset({0}), arrival_time=0.0
    )


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_take_the_argmax():
    x = logits()
    reqs = [
        req("a", temperature=0),
        req("b", temperature=0.8, top_k=1),
        req("c", temperature=0),
        req("d", temperature=0),
    ]
    tokens, lps = Sampler(torch.device("cpu")).sample(x, reqs)
    assert tokens == x.argmax(-1).tolist()
    assert lps == [None] * 4


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    x = logits(1, 1000)

    def draw(seed):
        s, r = Sampler(torch.device("cpu")), req("a", temperature=1.0, seed=seed)
        return [s.sample(x, [r])[0][0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_and_top_p_restrict_the_support():
    x = logits(1, 100)
    s = Sampler(torch.device("cpu"))
    top5 = set(torch.topk(x[0], 5).indices.tolist())
    r = req("a", temperature=1.5, top_k=5, seed=1)
    assert {s.sample(x, [r])[0][0] for _ in range(200)} <= top5
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1])
    r = req("b", temperature=1.0, top_p=0.5, seed=2)
    assert {s.sample(x, [r])[0][0] for _ in range(300)} <= nucleus


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    x = torch.zeros(1, 10)
    x[0, 0] = 100.0  # eos is by far the most likely
    x[0, 5] = 50.0
    r = req("a", temperature=0, min_tokens=2, stop_token_ids=(5,))
    s = Sampler(torch.device("cpu"))
    assert s.sample(x, [r])[0] == [x[0, 1:5].argmax().item() + 1]
    r.append_token(3)
    r.append_token(3)
    assert s.sample(x, [r])[0] == [0]


def test_penalties_push_repeated_tokens_down():
    x = torch.zeros(1, 10)
    x[0, 4] = 1.0
    r = req("a", temperature=0, frequency_penalty=0.6)
    s = Sampler(torch.device("cpu"))
    assert s.sample(x, [r])[0] == [4]
    r.append_token(4)
    r.append_token(4)  # 1.0 - 2 * 0.6 < 0
    assert s.sample(x, [r])[0] != [4]


def test_logprobs_are_the_raw_distribution_with_top_alternatives():
    x = logits(2, 30)
    reqs = [req("a", temperature=0, logprobs=3), req("b", temperature=0)]
    tokens, lps = Sampler(torch.device("cpu")).sample(x, reqs)
    ref = x[0].log_softmax(-1)
    lp = lps[0]
    assert lp.token_id == tokens[0]
    assert math.isclose(lp.logprob, ref[tokens[0]].item(), abs_tol=1e-5)
    assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
    assert lps[1] is None
