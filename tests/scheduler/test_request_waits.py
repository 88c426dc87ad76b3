"""A request's account of its time and of the work its preemptions threw away (pure: the time
is passed in)."""

from __future__ import annotations

import pytest

from scheduler.request import WAIT_CAUSES, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from tests.scheduler.test_batch_scheduler import make, req, run_step


def test_charges_add_up_to_the_time_since_arrival():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), frozenset(), arrival_time=10.0)
    assert set(r.waits) == set(WAIT_CAUSES) and sum(r.waits.values()) == 0.0
    r.charge("activation", 10.5)
    r.charge("queue", 10.75)
    r.charge("prefill", 10.75)  # an empty interval adds nothing
    r.charge("decode", 10.70)  # nor does a time before the last charge
    r.charge("decode", 11.0)
    assert r.waits["activation"] == pytest.approx(0.5)
    assert r.waits["queue"] == pytest.approx(0.25)
    assert r.waits["prefill"] == 0.0
    assert r.waits["decode"] == pytest.approx(0.25)
    assert sum(r.waits.values()) == pytest.approx(11.0 - r.arrival_time)
    assert r.charged_until == 11.0


def test_a_preemption_counts_the_computed_tokens_it_throws_away():
    s, kv = make(pages=2, blocks_per_page=2)  # 4 blocks = 16 tokens in all
    a, b = req(7, "a"), req(7, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts: 7 tokens each
    run_step(s)  # one decode step each: 8 computed
    assert (s.recomputed_tokens, b.recomputed_tokens) == (0, 0)
    run_step(s)  # a's next token needs a third block: b is preempted
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert b.recomputed_tokens == 8 and a.recomputed_tokens == 0
    assert s.recomputed_tokens == 8 and s.num_preemptions == 1
    s.finish(a)
    run_step(s)  # b recomputes its 9 tokens in one chunk
    s.preempt(b)  # and the balloon's last resort throws them away again
    assert b.recomputed_tokens == 8 + 9 and b.num_preemptions == 2
    assert s.recomputed_tokens == 17 and s.num_preemptions == 2
    s.finish(b)
    kv.check_integrity()
