"""Which cause a request's time goes to, read from its state and what the engine step did."""

from __future__ import annotations

import pytest

from prism_server.engine import wait_causes as wc
from scheduler.request import WAIT_CAUSES, Request, RequestStatus
from scheduler.sampling_params import SamplingParams


def request(
    status: RequestStatus = RequestStatus.WAITING,
    first_token: float | None = None,
    preemptions: int = 0,
) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), frozenset(), arrival_time=100.0)
    r.status, r.first_token_time, r.num_preemptions = status, first_token, preemptions
    return r


def test_the_causes_are_the_request_logs():
    names = [
        wc.OFFLOADED,
        wc.ACTIVATION,
        wc.KV,
        wc.OTHER_MODELS,
        wc.QUEUE,
        wc.PREFILL,
        wc.DECODE,
        wc.DECODE_OTHER_MODELS,
        wc.PREEMPTED,
    ]
    assert tuple(names) == WAIT_CAUSES


# (resident, blocked, own model stepped, other models stepped[, activating]) -> the cause of a
# waiting request
WAITING = [
    ((False, False, False, False), wc.OFFLOADED),  # offloaded or draining: room or its turn
    ((False, False, False, False, True), wc.ACTIVATION),  # its weights' copy in flight
    ((False, True, False, True), wc.OFFLOADED),  # not resident comes first
    ((False, True, False, True, True), wc.ACTIVATION),
    ((True, True, True, False), wc.KV),  # its model stepped, but it waits for blocks
    ((True, True, False, True), wc.KV),
    ((True, False, False, True), wc.OTHER_MODELS),
    ((True, False, True, False), wc.QUEUE),  # behind its own model's requests
    ((True, False, True, True), wc.QUEUE),  # its own model stepped without it
    ((True, False, False, False), wc.QUEUE),  # nothing stepped
]


@pytest.mark.parametrize(("state", "want"), WAITING)
def test_a_waiting_request(state, want):
    assert wc.cause(request(), *state) == want


def test_a_preempted_request_waits_to_be_recomputed_unless_its_model_left():
    r = request(preemptions=1, first_token=100.5)
    assert wc.cause(r, True, True, False, True) == wc.PREEMPTED
    assert wc.cause(r, True, False, True, False) == wc.PREEMPTED
    assert wc.cause(r, False, False, False, False) == wc.OFFLOADED
    assert wc.cause(r, False, False, False, False, True) == wc.ACTIVATION


@pytest.mark.parametrize(
    ("own", "others", "want"),
    [
        (True, False, wc.DECODE),
        (True, True, wc.DECODE),
        (False, True, wc.DECODE_OTHER_MODELS),
        (False, False, wc.DECODE),
    ],
)
def test_a_running_request_after_its_first_token(own, others, want):
    r = request(RequestStatus.RUNNING, first_token=100.5)
    assert wc.cause(r, True, False, own, others) == want


def test_a_running_request_before_its_first_token_is_in_prefill():
    r = request(RequestStatus.RUNNING)
    for own, others in [(True, False), (False, True), (False, False)]:
        assert wc.cause(r, True, False, own, others) == wc.PREFILL


def test_a_first_token_within_the_interval_ends_the_prefill_there():
    r = request(RequestStatus.RUNNING)
    wc.charge(r, wc.PREFILL, 100.2)
    r.first_token_time = 100.3  # sampled by the step that ends at 100.5
    wc.charge(r, wc.cause(r, True, False, True, False), 100.5)
    assert r.waits[wc.PREFILL] == pytest.approx(0.3)
    assert r.waits[wc.DECODE] == pytest.approx(0.2)
    assert sum(r.waits.values()) == pytest.approx(0.5)


def test_the_last_interval_of_a_request_that_ends():
    assert wc.closing_cause(request(RequestStatus.RUNNING)) == wc.PREFILL
    assert wc.closing_cause(request(RequestStatus.RUNNING, first_token=100.1)) == wc.DECODE
    assert wc.closing_cause(request()) == wc.QUEUE
    assert wc.closing_cause(request(preemptions=2, first_token=100.1)) == wc.PREEMPTED
