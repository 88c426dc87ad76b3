from __future__ import annotations

import math

import torch

from prism_server.engine.sampler import Sampler
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


def test_logit_bias_rows_are_batched_and_only_touch_their_row():
    x = logits(3, 50)
    top = x.argmax(-1).tolist()
    reqs = [
        req("a", temperature=0, logit_bias=((top[0], -100.0),)),
        req("b", temperature=0),
        req("c", temperature=0, logit_bias=((7, 100.0), (top[2], -100.0))),
    ]
    tokens, _ = Sampler(torch.device("cpu")).sample(x, reqs)
    masked = x[0].clone()
    masked[top[0]] -= 100
    assert tokens == [int(masked.argmax()), top[1], 7]


def test_repetition_penalty_follows_vllms_rule_over_prompt_and_output():
    x = torch.tensor([[2.0, -1.0, 1.9, 0.5, -3.0]])
    r = Request(
        "a",
        [0],
        SamplingParams(temperature=0, repetition_penalty=1.5),
        eos_token_ids=frozenset(),
        arrival_time=0.0,
    )
    r.output_token_ids.append(1)
    r.all_token_ids.append(1)
    s = Sampler(torch.device("cpu"))
    # token 0 (prompt): 2.0 / 1.5 = 1.33 < 1.9, so token 2 wins; token 1 (output): -1.5
    assert s.sample(x, [r])[0] == [2]
    adjusted = x.clone()
    from prism_server.engine.sampler import _adjust

    _adjust(adjusted, [(0, r)])
    assert torch.allclose(adjusted, torch.tensor([[2.0 / 1.5, -1.5, 1.9, 0.5, -3.0]]))


def test_frequency_and_presence_penalties_batched_match_the_definition():
    x = logits(2, 20)
    rs = []
    for i, (fp, pp) in enumerate([(0.5, 0.25), (1.0, -0.5)]):
        r = req(f"r{i}", temperature=0, frequency_penalty=fp, presence_penalty=pp)
        for t in (3, 3, 5 + i):
            r.output_token_ids.append(t)
        rs.append(r)
    from prism_server.engine.sampler import _adjust

    got = x.clone()
    _adjust(got, [(0, rs[0]), (1, rs[1])])
    want = x.clone()
    for i, r in enumerate(rs):
        for t in set(r.output_token_ids):
            n = r.output_token_ids.count(t)
            want[i, t] -= r.params.frequency_penalty * n + r.params.presence_penalty
    assert torch.allclose(got, want)


def test_min_p_keeps_only_tokens_near_the_most_likely():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    s = Sampler(torch.device("cpu"))
    r = req("a", temperature=1.0, min_p=0.15, seed=3)  # keeps p >= 0.075: tokens 0, 1, 2
    assert {s.sample(x, [r])[0][0] for _ in range(300)} == {0, 1, 2}


def filtered(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from: temperature, min-p, top-k, softmax, top-p."""
    row = row / p.temperature
    if p.min_p > 0:
        row = row.masked_fill(row < row.max() + math.log(p.min_p), float("-inf"))
    if 0 < p.top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = row.softmax(-1)
    if p.top_p < 1.0:
        sp, idx = probs.sort(descending=True)
        probs = probs.scatter(0, idx, sp.masked_fill(sp.cumsum(-1) - sp > p.top_p, 0.0))
    return probs / probs.sum()


MIXED = [
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0),
]


def draws_follow_each_rows_distribution(device: str) -> None:
    """Rows of different settings drawn together by sample_batch on `device`: each row's tokens
    have its own distribution (total variation against the exact one, 4000 draws a row)."""
    from prism_server.engine.sampler import sample_batch

    torch.manual_seed(0)
    x = logits(len(MIXED), 12, seed=3)
    draws = 4000
    rows = x.repeat(draws, 1).to(device)
    got = sample_batch(rows, MIXED * draws).view(draws, len(MIXED)).cpu()
    for j, p in enumerate(MIXED):
        want = filtered(x[j], p)
        seen = torch.bincount(got[:, j], minlength=12).float() / draws
        assert set(got[:, j].tolist()) <= set(torch.nonzero(want).flatten().tolist())
        assert (seen - want).abs().sum() / 2 < 0.04, (j, seen, want)


def test_a_batched_draw_follows_each_rows_own_filtered_distribution():
    draws_follow_each_rows_distribution("cpu")


def test_greedy_seeded_and_unseeded_rows_share_a_step():
    """A step mixing greedy, seeded and unseeded rows: the greedy rows are the argmax, a seeded
    row's tokens are those it draws alone, the unseeded rows stay in their support."""
    x = logits(4, 200, seed=5)
    mixed = [
        req("g", temperature=0),
        req("s", temperature=1.0, seed=11),
        req("u", temperature=1.0, top_k=4),
        req("g2", temperature=0.5, top_k=1),
    ]
    s = Sampler(torch.device("cpu"))
    runs = [s.sample(x, mixed)[0] for _ in range(30)]
    alone_s = Sampler(torch.device("cpu"))
    alone = [alone_s.sample(x[1:2], [req("s", temperature=1.0, seed=11)])[0][0] for _ in range(30)]
    assert [r[1] for r in runs] == alone
    assert all(r[0] == int(x[0].argmax()) and r[3] == int(x[3].argmax()) for r in runs)
    top4 = set(torch.topk(x[2], 4).indices.tolist())
    assert {r[2] for r in runs} <= top4 and len({r[2] for r in runs}) > 1
