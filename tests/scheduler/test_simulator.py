"""The device simulator (the engine's decisions in simulated time), and what it shows of the
arbitrator: a long prompt beside other models' decodes is chunked into steps worth running, and
streams keep their mean TPOT through it."""

from __future__ import annotations

import pytest

from scheduler.latency_model import LatencyModel
from scheduler.request import MAX_GAP_SLOS, TPOT_MARGIN, Request
from scheduler.sampling_params import SamplingParams
from scheduler.simulator import SimArrival, SimModel, simulate


def _lat(c0: float, per_token: float) -> LatencyModel:
    return LatencyModel((c0, per_token, 2e-5, 2e-6))


# H200-like steps: an 8B model (7 ms a decode step, 28 us a prefill token) and smaller ones
MODELS = [
    SimModel("big", _lat(7e-3, 28e-6), ttft_slo_s=0.635, tpot_slo_s=0.038),
    SimModel("mid", _lat(7.5e-3, 29e-6), ttft_slo_s=0.32, tpot_slo_s=0.040),
    SimModel("small", _lat(5e-3, 8e-6), ttft_slo_s=0.167, tpot_slo_s=0.027),
    SimModel("tiny", _lat(4e-3, 3e-6), ttft_slo_s=0.20, tpot_slo_s=0.022),
]


def test_one_request_alone_takes_its_prefill_then_one_step_a_token():
    lat = _lat(5e-3, 1e-5)
    sim = simulate([SimModel("m", lat, 1.0, 1.0)], [SimArrival(1.0, "m", 1000, 5)])
    (r,) = sim.results
    assert r.ttft_s == pytest.approx(lat.prefill_s(1000))
    assert r.tpot_s == pytest.approx(lat.decode_s(1, 1001), rel=0.01)
    assert [s.prefill_tokens for s in sim.steps] == [1000, 0, 0, 0, 0]
    assert sim.attainment() == 1.0


def test_a_long_prompt_beside_three_models_decodes_keeps_every_slo():
    """Three streams decode when a 4096-token prompt of the big model arrives, then two more
    prompts: the prompt is prefilled in chunks worth a step (never below the latency model's
    knee), the streams spend the slack they banked and none stalls past MAX_GAP_SLOS x its SLO.
    (Chunks sized to every stream's next-token deadline made this prompt wait 2.7 s in 16-token
    chunks and stalled the streams for 2.2 s.)"""
    arrivals = [
        SimArrival(0.0, "mid", 400, 300),
        SimArrival(0.01, "small", 200, 300),
        SimArrival(0.02, "tiny", 300, 300),
        SimArrival(0.3, "big", 4096, 20),
        SimArrival(0.35, "small", 768, 60),
        SimArrival(0.4, "tiny", 1325, 15),
    ]
    sim = simulate(MODELS, arrivals)
    assert sim.attainment() == 1.0, [r for r in sim.results if not (r.met_ttft and r.met_tpot)]
    slo = {m.name: m for m in MODELS}
    for r in sim.results:
        assert r.max_gap_s <= MAX_GAP_SLOS * slo[r.arrival.model].tpot_slo_s + 0.02
    big = next(r for r in sim.results if r.arrival.model == "big")
    alone = MODELS[0].device_latency.prefill_s(4096)
    assert big.ttft_s < 2.5 * alone
    knee = MODELS[0].device_latency.knee_tokens()
    chunks = [s.prefill_tokens for s in sim.steps if s.model == "big" and s.prefill_tokens]
    assert sum(chunks) == 4096 and all(c >= knee for c in chunks[:-1]), chunks


def test_the_deadline_of_a_stream_keeps_its_mean_tpot_and_caps_its_gap():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), frozenset(), arrival_time=0.0)
    r.ttft_slo, r.tpot_slo = 0.5, 0.1
    assert r.deadline == 0.5  # before its first token: the TTFT deadline
    r.append_token(7)
    r.first_token_time = r.last_token_time = 0.2
    # the second token: one SLO after the first, less the margin a plan keeps in reserve
    assert r.deadline == pytest.approx(0.2 + 0.1 * (1 - TPOT_MARGIN)) and 0 < TPOT_MARGIN < 0.2
    for _ in range(9):  # nine more, fast (10 ms each): they bank 90 ms each
        r.append_token(7)
        r.last_token_time += 0.01
    assert r.last_token_time == pytest.approx(0.29)
    # mean-keeping deadline: first + 10 x 0.1 (less the margin) = 1.15; capped at the latest
    # + 4 SLOs = 0.69
    assert r.deadline == pytest.approx(0.29 + MAX_GAP_SLOS * 0.1)
    r.last_token_time = 1.0  # one slow gap later: the banked budget binds
    assert r.deadline == pytest.approx(0.2 + 10 * 0.1 * (1 - TPOT_MARGIN))


def test_the_knee_is_where_a_chunks_tokens_cost_what_its_step_does():
    lat = LatencyModel((6e-3, 3e-5, 0.0, 0.0))
    assert lat.knee_tokens() == 200
    assert LatencyModel((6e-3, 0.0, 0.0, 0.0)).knee_tokens() == 1


def test_another_models_prefill_is_chunked_so_a_tight_prompt_starts_in_time():
    """A 14B-like model prefills a long prompt (2048-token chunks of ~0.16 s) when a small model's
    prompt arrives with 0.3 s to its first token: the big model's next chunk is cut to end
    before the small prompt's latest start, and the small prompt, once started, finishes its
    own chunks before the big one resumes. (Chunks bounded only by decoding streams ran the big
    prefill on in full chunks and made the small prompt 1.3 s late.)"""
    big = SimModel("big", _lat(9e-3, 75e-6), ttft_slo_s=3.0, tpot_slo_s=0.045)
    small = SimModel("small", _lat(2e-3, 6e-6), ttft_slo_s=0.3, tpot_slo_s=0.05)
    arrivals = [SimArrival(0.0, "big", 6144, 4), SimArrival(0.2, "small", 6144, 4)]
    sim = simulate([big, small], arrivals)
    by = {r.arrival.model: r for r in sim.results}
    assert by["small"].met_ttft, by["small"]
    assert by["big"].met_ttft, by["big"]
    # the chunk running when the small prompt arrived was cut short
    big_chunks = [s.prefill_tokens for s in sim.steps if s.model == "big" and s.prefill_tokens]
    assert min(big_chunks) < 2048
    # the small prompt's chunks ran back to back once it started
    order = [s.model for s in sim.steps if s.prefill_tokens]
    first = order.index("small")
    assert order[first : first + order.count("small")] == ["small"] * order.count("small")


def test_a_static_kv_quota_queues_a_burst_that_unbounded_kv_batches():
    """Six 1000-token prompts at once to a model whose KV room holds two of them (a static
    partition's quota): at most two run at a time and the last waits for two generations to
    end; with the room unbounded (the balloon) all six decode in one batch."""
    lat = _lat(5e-3, 1e-5)
    burst = [SimArrival(0.0, "m", 1000, 50) for _ in range(6)]
    room = 2 * -(-1050 // 16)  # two requests' blocks
    bounded = simulate([SimModel("m", lat, 1.0, 1.0, kv_blocks=room)], burst)
    free = simulate([SimModel("m", lat, 1.0, 1.0)], burst)
    assert max(s.decodes for s in bounded.steps) == 2
    assert max(s.decodes for s in free.steps) == 6
    last = max(r.ttft_s for r in bounded.results)
    assert last > 2 * 50 * lat.decode_s(2, 2000)  # behind two rounds of two generations
    assert max(r.ttft_s for r in free.results) < 0.1
    assert len(bounded.results) == len(free.results) == 6
    with pytest.raises(ValueError, match="never fit"):
        simulate([SimModel("m", lat, 1.0, 1.0, kv_blocks=10)], burst)


def test_a_loose_long_prompt_makes_way_for_tighter_ones_that_came_after_it():
    """A 14B-like prompt with a loose TTFT SLO starts; two 8B-like prompts with a tighter SLO
    and a 1B-like one with a tight SLO arrive while it prefills. Prefilled first come first,
    the 14B's long prefill and the decodes it starts push both 8B prompts past their SLO; by
    least laxity every prompt gets its first token in time, the 14B's too, and every stream
    keeps its TPOT."""
    big = SimModel("big", _lat(9e-3, 60e-6), ttft_slo_s=1.8, tpot_slo_s=0.065)
    mid = SimModel("mid", _lat(7e-3, 35e-6), ttft_slo_s=0.9, tpot_slo_s=0.04)
    tiny = SimModel("tiny", _lat(2e-3, 8e-6), ttft_slo_s=0.3, tpot_slo_s=0.015)
    arrivals = [
        SimArrival(0.0, "big", 6144, 64),
        SimArrival(0.08, "mid", 6144, 16),
        SimArrival(0.08, "mid", 6144, 16),
        SimArrival(0.2, "tiny", 6144, 16),
    ]
    sim = simulate([big, mid, tiny], arrivals)
    assert all(r.met_ttft and r.met_tpot for r in sim.results), [
        (r.arrival.model, round(r.ttft_s, 3)) for r in sim.results
    ]


def test_noise_stretches_each_step_by_its_draw():
    """A noise of 2 doubles every step the simulator runs; the decisions still come from the
    cost model (the arbitrator does not know the noise)."""
    lat = LatencyModel((2e-3, 1e-5, 0.0, 0.0))
    m = SimModel("m", lat, ttft_slo_s=10.0, tpot_slo_s=1.0)
    arrivals = [SimArrival(0.0, "m", 100, 4), SimArrival(0.001, "m", 50, 3)]
    calm = simulate([m], arrivals)
    seen = []

    def double(model, shape):
        seen.append((model, shape.tokens))
        return 2.0

    noisy = simulate([m], arrivals, noise=double)
    assert [s.seconds for s in noisy.steps] == pytest.approx([2 * s.seconds for s in calm.steps])
    assert len(seen) == len(noisy.steps) and {mod for mod, _ in seen} == {"m"}
    assert noisy.results[0].ttft_s == pytest.approx(2 * calm.results[0].ttft_s)
