"""Draining a model for eviction: every running request goes back to the queue, blocks freed."""

from __future__ import annotations

from scheduler.request import RequestStatus
from tests.scheduler.test_batch_scheduler import make, req, run_step


def test_preempt_all_requeues_in_admission_order_and_frees_every_block():
    s, kv = make(pages=8)
    a, b, c = req(5, "a"), req(6, "b"), req(3, "c")
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    run_step(s)  # all three decoding, with outputs
    assert s.preempt_all() == 3
    assert list(s.waiting) == [a, b, c] and not s.running and not kv.used
    assert all(r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 for r in (a, b, c))
    assert a.num_output_tokens == 2  # outputs kept, recomputed later
    assert [x for x, _ in run_step(s)] == ["a", "b", "c"]
    for r in (a, b, c):
        s.finish(r)
    kv.check_integrity()
