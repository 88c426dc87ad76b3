"""The latency model: its fit recovers a known cost law, follows a change online, reports its
error, and sizes prefill chunks within a time budget."""

from __future__ import annotations

import random

import pytest

from scheduler.latency_model import LatencyModel, StepShape, nnls

# c0, per token, per sequence, per 1k attention pairs, per 1k KV tokens read, per prefill step: a
# decode step's context costs sixty times a prefill's pair (memory against compute), and a step
# with prefill tokens runs eagerly (kernel by kernel, not a graph), as on a GPU
TRUE = (3e-3, 4e-5, 2e-5, 5e-7, 3e-5, 2e-2)


def _time(shape: StepShape, coef=TRUE, noise: float = 0.0, rng=None) -> float:
    t = sum(c * f for c, f in zip(coef, shape.features()))
    return t * (1 + (rng.uniform(-noise, noise) if rng else 0.0))


def _profile_shapes() -> list[StepShape]:
    shapes = [StepShape.prefill(n) for n in (16, 128, 512, 2048)]
    shapes += [StepShape.decode(b, b * ctx) for b in (1, 4, 16, 64) for ctx in (128, 1024)]
    return shapes


def test_the_profile_fit_recovers_the_cost_law():
    lm = LatencyModel()
    lm.fit_profile([(s, _time(s)) for s in _profile_shapes()])
    assert lm.profiled
    for s in [StepShape.prefill(1000, 3000), StepShape.decode(32, 32 * 700)]:
        assert abs(lm.estimate(s) - _time(s)) / _time(s) < 1e-6


def test_decode_context_and_prefill_attention_are_priced_apart():
    lm = LatencyModel()
    lm.fit_profile([(s, _time(s)) for s in _profile_shapes()])
    long_decode = StepShape.decode(16, 16 * 6000)  # its context is most of its cost
    late_chunk = StepShape.prefill(2048, 4096)  # its attention pairs are a large part of its cost
    for s in (long_decode, late_chunk):
        assert abs(lm.estimate(s) - _time(s)) / _time(s) < 1e-6
    assert lm.coefficients[4] > 10 * lm.coefficients[3]
    # a record from before the kv and prefill terms still loads
    assert LatencyModel(TRUE[:4]).coefficients == (*TRUE[:4], 0.0, 0.0)


def test_a_small_prefill_chunk_pays_the_prefill_steps_fixed_cost():
    lm = LatencyModel()
    lm.fit_profile([(s, _time(s)) for s in _profile_shapes()])
    small = StepShape.prefill(245)
    assert abs(lm.estimate(small) - _time(small)) / _time(small) < 1e-6
    assert lm.estimate(small) > 2 * lm.estimate(StepShape.decode(1, 245))
    # the smallest chunk worth a step: its tokens cost what the step's fixed costs do
    c0, c_tok, c_seq, *_, c_pf = TRUE
    assert lm.knee_tokens() == -(-(c0 + c_seq + c_pf) // c_tok)


def test_online_samples_follow_a_slower_device_and_the_error_falls():
    rng = random.Random(0)
    lm = LatencyModel()
    lm.fit_profile([(s, _time(s)) for s in _profile_shapes()])
    slow = tuple(c * 1.5 for c in TRUE)
    errors = []
    for _ in range(400):
        s = StepShape.decode(rng.randint(1, 64), rng.randint(64, 4096) * 8)
        before = lm.estimate(s)
        assert lm.observe(s, _time(s, slow, 0.02, rng)) == before
        errors.append(lm.error)
    assert errors[20] > 0.2  # right after the change the estimates are a third short
    assert lm.error < 0.05
    s = StepShape.decode(8, 8000)
    assert abs(lm.estimate(s) - _time(s, slow)) / _time(s, slow) < 0.05
    assert lm.observed == 400


def test_nnls_keeps_coefficients_non_negative():
    rows = [[1.0, x, 0.0] for x in range(10)]
    y = [5.0 - 0.1 * x for x in range(10)]  # a falling line: the slope would be negative
    x = nnls(rows, y)
    assert all(v >= 0 for v in x) and x[1] == 0.0


def test_max_new_tokens_is_the_largest_chunk_within_the_budget():
    lm = LatencyModel(TRUE)
    base = StepShape.decode(4, 4000)
    for budget in (0.004, 0.01, 0.05, 0.2):
        n = lm.max_new_tokens(budget, base, cached=500, cap=8192)
        if n:
            assert lm.estimate(base + StepShape.prefill(n, 500)) <= budget
        if n < 8192:
            assert lm.estimate(base + StepShape.prefill(n + 1, 500)) > budget
    assert lm.max_new_tokens(0.0, base, 0, 100) == 0
    assert lm.max_new_tokens(100.0, base, 0, 100) == 100


def test_prefill_costs_stay_known_through_a_long_run_of_decode_steps():
    # a profile cut short (a large model within its time budget) has small prefills only, whose
    # tokens cost more than a full chunk's (GEMMs run faster on more rows); the traffic's own
    # full chunks correct that, and must still count after thousands of decode steps
    def device(s: StepShape) -> float:
        small = s.tokens > s.seqs and s.tokens < 1024
        return _time(s) * (1.25 if small else 1.0)

    rng = random.Random(1)
    lm = LatencyModel()
    small = [StepShape.prefill(n) for n in (16, 128, 512)]
    small += [StepShape.decode(b, b * ctx) for b in (1, 4, 16, 64) for ctx in (128, 1024)]
    lm.fit_profile([(s, device(s)) for s in small])
    chunk = StepShape.prefill(2048, 4096)
    for cached in (0, 2048, 4096, 0, 2048, 4096):
        s = StepShape.prefill(2048, cached)
        lm.observe(s, device(s))
    for _ in range(3000):
        s = StepShape.decode(rng.randint(1, 40), rng.randint(200, 6000) * 8)
        lm.observe(s, device(s))
    assert len(lm.recent_prefill) == 6 and len(lm.recent) == lm.recent.maxlen
    assert abs(lm.estimate(chunk) - device(chunk)) / device(chunk) < 0.05


def test_the_fit_kept_as_samples_come_and_go_is_the_fit_of_the_samples_held():
    """The normal equations are updated as a sample enters and the window's oldest leaves: after
    many steps (both windows full and turned over), the coefficients are those of a fit over
    the samples held, summed from scratch."""
    rng = random.Random(0)
    lm = LatencyModel(window=32, prefill_window=8, refit_every=1)
    lm.fit_profile([(StepShape.decode(b, 1000 * b), 1e-3 * (1 + b / 50)) for b in (1, 8, 64)])
    for _ in range(500):
        if rng.random() < 0.2:
            n = rng.choice([64, 512, 4096])
            shape, t = StepShape.prefill(n, rng.choice([0, 256])), 2e-3 + 1e-5 * n
        else:
            b = rng.randint(1, 64)
            shape, t = StepShape.decode(b, b * rng.randint(100, 4000)), 1e-3 * (1 + b / 80)
        lm.observe(shape, t * (1 + 0.1 * rng.random()))
    held = [*lm.recent, *lm.recent_prefill]
    assert len(held) == 40
    w = max(0.1, 1.0 - len(held) / 40)
    samples = [(s, t, w) for s, t in lm.profile] + [(s, t, 1.0) for s, t in held]
    rows = [[wt * f / t for f in s.features()] for s, t, wt in samples]
    expected = nnls(rows, [wt for *_, wt in samples])
    assert lm.coefficients == pytest.approx(expected, rel=1e-9, abs=1e-15)
