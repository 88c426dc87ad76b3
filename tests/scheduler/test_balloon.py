"""The balloon's decisions and the three policies, over plain data: who gives reserves, which idle
model is evicted, who takes, who is within reach, which request is preempted, whose turn it is
under time sharing, and which shards another device gets back."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.balloon import (
    ModelState,
    RunningRequest,
    admitting,
    eviction_order,
    expired,
    last_resort,
    may_activate,
    next_taker,
    pages_needed,
    preempt_victim,
    preemptible,
    reclaim_order,
    shards_to_release,
    swap_turn,
    within_reach,
)
from scheduler.policy import POLICIES, PrismPolicy, StaticPolicy, SwapPolicy, policy
from scheduler.snapshot import Residency

R, O, A, D = Residency.RESIDENT, Residency.OFFLOADED, Residency.ACTIVATING, Residency.DRAINING


@dataclass(frozen=True)
class Owner:
    name: str
    reclaimable: int
    last_grow: int


def _m(name: str, residency: Residency = R, **kw) -> ModelState:
    return ModelState(name, residency, **kw)


# ---- reserves ------------------------------------------------------------------------------------
def test_least_recently_grown_gives_first_and_the_requester_never():
    owners = [Owner("a", 3, 7), Owner("b", 2, 2), Owner("c", 0, 1), Owner("d", 1, 9)]
    assert reclaim_order(owners, "d") == ["b", "a"]  # c has nothing to give; d is asking
    assert reclaim_order(owners, "x") == ["b", "a", "d"]
    assert reclaim_order([], "a") == []


def test_idle_owners_give_before_busy_ones_whatever_they_grew():
    owners = [Owner("a", 3, 1), Owner("b", 2, 5), Owner("c", 4, 3)]
    assert reclaim_order(owners, "x", busy=frozenset({"a"})) == ["c", "b", "a"]
    assert reclaim_order(owners, "x", busy=frozenset({"a", "b", "c"})) == ["a", "c", "b"]


# ---- idle eviction and keep-alive ----------------------------------------------------------------
def test_eviction_takes_idle_evictable_resident_models_least_recently_used_first():
    models = [
        _m("new", last_used=9.0),
        _m("old", last_used=1.0),
        _m("busy", last_used=0.0, requests=1, running=1),
        _m("pinned", last_used=0.5, evictable=False),
        _m("away", O, last_used=0.1),
        _m("coming", A, last_used=0.2),
        _m("leaving", D, last_used=0.3),
        _m("mid", last_used=5.0),
    ]
    assert eviction_order(models) == ["old", "mid", "new"]
    assert eviction_order(models, keep=frozenset({"old", "x"})) == ["mid", "new"]
    assert eviction_order([]) == []


def test_a_stalled_model_may_go_only_when_asked_for_and_never_a_running_one():
    models = [
        _m("stalled", last_used=0.0, requests=2, running=0),  # all its requests wait
        _m("running", last_used=0.1, requests=2, running=1),
        _m("idle", last_used=3.0),
    ]
    assert eviction_order(models) == ["idle"]
    assert eviction_order(models, stalled=True) == ["stalled", "idle"]


def test_eviction_ties_keep_the_devices_order():
    models = [_m("b", last_used=1.0), _m("a", last_used=1.0), _m("c", last_used=0.0)]
    assert eviction_order(models) == ["c", "b", "a"]


def test_keep_alive_expiry_returns_the_due_and_the_next_deadline():
    deadlines = [("a", 5.0), ("b", None), ("c", 10.0), ("d", 12.0), ("e", 10.0)]
    assert expired(deadlines, 10.0) == (["a", "c", "e"], 12.0)
    assert expired(deadlines, 4.0) == ([], 5.0)
    assert expired([("b", None)], 4.0) == ([], None)
    assert expired([], 0.0) == ([], None)


# ---- the taker -----------------------------------------------------------------------------------
def test_no_starved_model_and_no_taker_means_no_one_takes():
    assert next_taker(None, []) is None


def test_a_resident_starved_model_takes_before_an_offloaded_one_then_first_come():
    starved = [
        _m("off-early", O, has_work=True, first_arrival=1.0),
        _m("on-late", R, has_work=True, first_arrival=5.0),
        _m("on-early", R, has_work=True, first_arrival=2.0),
    ]
    assert next_taker(None, starved) == "on-early"
    assert next_taker(None, starved[:1]) == "off-early"
    tie = [_m("b", has_work=True, first_arrival=1.0), _m("a", has_work=True, first_arrival=1.0)]
    assert next_taker(None, tie) == "a"  # by name: deterministic


def test_the_taker_keeps_its_turn_while_nothing_of_it_runs_or_it_is_still_starved():
    other = _m("other", has_work=True, first_arrival=0.0)
    activating = _m("t", A, has_work=True, running=0, first_arrival=9.0)
    assert next_taker(activating, [other]) == "t"  # not starved now, but nothing of it runs
    still = _m("t", R, has_work=True, running=1, first_arrival=9.0)
    assert next_taker(still, [other, still]) == "t"  # runs something, but its new work waits
    assert next_taker(still, [other]) == "other"  # its new work runs: the turn passes
    done = _m("t", R, has_work=False)
    assert next_taker(done, [other]) == "other"  # no work left
    assert next_taker(done, []) is None


def test_while_models_are_starved_only_they_admit_and_the_taker_alone_when_one_takes():
    assert admitting(frozenset(), None) == frozenset()  # everyone admits
    assert admitting(frozenset({"a", "b"}), None) == {"a", "b"}
    assert admitting(frozenset({"a", "b"}), "b") == {"b"}
    assert admitting(frozenset(), "a") == {"a"}  # a taker keeps its turn after its new work ran


# ---- within reach --------------------------------------------------------------------------------
def test_pages_needed_rounds_blocks_up_to_pages_and_adds_the_weights():
    assert pages_needed(blocks=5, free_blocks=0, blocks_per_page=4, weight_pages=0) == 2
    assert pages_needed(blocks=5, free_blocks=1, blocks_per_page=4, weight_pages=0) == 1
    assert pages_needed(blocks=3, free_blocks=8, blocks_per_page=4, weight_pages=0) == 0
    assert pages_needed(blocks=1, free_blocks=0, blocks_per_page=4, weight_pages=7) == 8


def test_reach_counts_others_kv_and_idle_evictable_weights_only():
    others = [
        _m("me", kv_pages=100, weight_pages=100),  # never counts for itself
        _m("busy", kv_pages=3, weight_pages=10, requests=1),  # KV only: its weights stay
        _m("idle", kv_pages=2, weight_pages=10),  # both
        _m("pinned", kv_pages=1, weight_pages=10, evictable=False),  # KV only
        _m("away", O, kv_pages=50, weight_pages=50),  # holds nothing here
        _m("leaving", D, kv_pages=4, weight_pages=10, requests=1),  # KV only
    ]
    reach = 5 + 3 + 2 + 10 + 1 + 4 + 6  # available + KV + idle weights + foreign KV
    assert within_reach(reach, "me", 5, others, foreign_kv=6)
    assert not within_reach(reach + 1, "me", 5, others, foreign_kv=6)
    assert within_reach(0, "me", 0, [])
    assert not within_reach(1, "me", 0, [])


# ---- last resorts --------------------------------------------------------------------------------
def test_a_starved_model_that_is_not_the_taker_waits_its_turn():
    m = _m("a", has_new_work=True)
    assert last_resort(m, frozenset({"a", "b"}), "b") is None
    r = last_resort(m, frozenset({"a", "b"}), "a")
    assert r is not None and r.keep == {"a"} and r.stalled and r.new_work


def test_a_blocked_model_keeps_the_taker_and_evicts_stalled_models_only_when_no_one_takes():
    growing = _m("g", running=2, requests=2)  # blocked on its running requests' growth
    r = last_resort(growing, frozenset({"t"}), "t")
    assert r is not None and r.keep == {"g", "t"} and not r.stalled and not r.new_work
    r = last_resort(growing, frozenset(), None)
    assert r is not None and r.keep == {"g"} and not r.stalled
    # nothing of it runs and no one takes: a stalled model may go for it (no deadlock)
    stuck = _m("s", running=0, requests=2)
    assert last_resort(stuck, frozenset(), None).stalled
    assert not last_resort(stuck, frozenset({"t"}), "t").stalled


def test_only_new_work_of_a_starved_model_may_preempt():
    recompute = _m("a", has_new_work=False)  # only a preempted request's recompute waits
    assert not last_resort(recompute, frozenset({"a"}), "a").new_work
    unstarved = _m("a", has_new_work=True)  # beyond reach: not starved
    assert not last_resort(unstarved, frozenset(), None).new_work


def test_new_work_past_its_ttft_deadline_preempts_nothing():
    late = _m("a", has_new_work=True, first_deadline=10.0)
    assert last_resort(late, frozenset({"a"}), "a", now=9.9).new_work
    r = last_resort(late, frozenset({"a"}), "a", now=10.0)
    assert r is not None and not r.new_work and r.stalled  # it may still evict idle models


# ---- preemption ----------------------------------------------------------------------------------
def test_the_victim_has_the_least_to_recompute_then_arrived_last():
    reqs = [
        RunningRequest("a", "r1", 50, 1.0),
        RunningRequest("b", "r2", 10, 1.0),
        RunningRequest("b", "r3", 10, 2.0),
        RunningRequest("a", "r4", 200, 3.0),
    ]
    assert preempt_victim(reqs).request_id == "r3"
    assert preempt_victim(reqs[:2]).request_id == "r2"
    tie = [RunningRequest("a", "y", 1, 1.0), RunningRequest("b", "x", 1, 1.0)]
    assert preempt_victim(tie).request_id == "x"


def test_one_victim_covers_the_new_work_rather_than_a_cascade_of_small_ones():
    reqs = [
        RunningRequest("a", "small", 10, 1.0, pages=0.5),
        RunningRequest("a", "fits", 120, 1.0, pages=2),
        RunningRequest("b", "big", 400, 2.0, pages=1.5),  # another model's KV: fewer bytes a token
    ]
    assert preempt_victim(reqs, need_pages=1.5).request_id == "fits"  # least recompute that covers
    assert preempt_victim(reqs, need_pages=2).request_id == "fits"
    # none covers alone: the one that frees the most
    assert preempt_victim(reqs, need_pages=3).request_id == "fits"
    assert preempt_victim(reqs[::2], need_pages=3).request_id == "big"
    assert preempt_victim(reqs, need_pages=0).request_id == "small"


def test_a_request_is_preempted_once_at_most_and_never_once_finished():
    reqs = [
        RunningRequest("a", "again", 0, 9.0, preemptions=1),
        RunningRequest("a", "done", 1, 9.0, finished=True),
        RunningRequest("b", "ok", 500, 0.0),
    ]
    assert [r.request_id for r in preemptible(reqs)] == ["ok"]
    assert preempt_victim(reqs).request_id == "ok"
    assert preempt_victim(reqs[:2]) is None
    assert preempt_victim([]) is None


# ---- other devices' shards -----------------------------------------------------------------------
def test_shards_released_are_idle_resident_evictable_models_split_over_that_device():
    models = [
        _m("idle", shard_devices=("cuda:1",)),
        _m("busy", shard_devices=("cuda:1",), requests=1, running=1),
        _m("starved", shard_devices=("cuda:1",), requests=1),
        _m("pinned", shard_devices=("cuda:1",), evictable=False),
        _m("elsewhere", shard_devices=("cuda:2",)),
        _m("away", O, shard_devices=("cuda:1",)),
        _m("local"),
    ]
    idle, busy = shards_to_release(models, "cuda:1", frozenset({"starved"}))
    assert idle == ["idle"]
    assert busy == ["idle", "busy", "pinned"]  # preempted from only when none is idle
    assert shards_to_release(models, "cuda:3", frozenset()) == ([], [])


# ---- time sharing --------------------------------------------------------------------------------
def test_swap_turn_goes_to_the_longest_waiting_offloaded_model_once_a_place_is_free():
    models = [
        _m("late", O, has_work=True, oldest_arrival=5.0),
        _m("early", O, has_work=True, oldest_arrival=1.0),
        _m("quiet", O),
    ]
    assert swap_turn(1, models) == {"early"}
    assert swap_turn(1, [*models, _m("on", R)]) == frozenset()  # the place is taken
    assert swap_turn(1, [*models, _m("leaving", D)]) == frozenset()  # until it has left
    assert swap_turn(2, [*models, _m("on", R)]) == {"early"}
    assert swap_turn(1, [_m("quiet", O)]) == frozenset()  # nobody waits


# ---- the policies --------------------------------------------------------------------------------
def test_policy_names_and_the_factory():
    assert set(POLICIES) == {"prism", "static", "swap"}
    for name in POLICIES:
        assert policy(name).name == name
    with pytest.raises(ValueError, match="policy must be one of"):
        policy("fifo")


def test_each_policy_states_what_the_engine_reads():
    p, st, sw = PrismPolicy(), StaticPolicy(), SwapPolicy()
    assert (p.reserve_output_tokens, st.reserve_output_tokens, sw.reserve_output_tokens) == (
        1024,
        0,
        0,
    )
    assert (p.plan, st.plan, sw.plan) == (True, False, False)
    assert (p.all_resident, st.all_resident, sw.all_resident) == (False, True, False)
    assert (p.max_resident, st.max_resident, sw.max_resident) == (None, None, 1)
    assert (p.keep_alive_s, st.keep_alive_s, sw.keep_alive_s) == (None, None, 0.0)
    assert (p.reclaims(), st.reclaims(), sw.reclaims()) == (True, False, True)


def test_only_prism_arbitrates_and_the_baselines_never_build_the_work():
    built = []

    def work():
        built.append(1)
        return []

    assert SwapPolicy().pick(work, 0.0, 0.0) is None
    assert StaticPolicy().pick(work, 0.0, 0.0) is None
    assert built == []
    assert PrismPolicy().pick(work, 0.0, 0.0) is None  # nothing to pick from
    assert built == [1]


def test_only_prism_takes_memory_from_other_models():
    starved = [_m("a", has_work=True, has_new_work=True)]
    assert PrismPolicy().next_taker(None, starved) == "a"
    assert PrismPolicy().last_resort(starved[0], frozenset({"a"}), "a", 0.0) is not None
    for baseline in (StaticPolicy(), SwapPolicy()):
        assert baseline.next_taker(None, starved) is None
        assert baseline.last_resort(starved[0], frozenset({"a"}), None, 0.0) is None


def test_only_swap_limits_whose_turn_it_is_and_only_it_reads_the_states():
    read = []

    def states():
        read.append(1)
        return [_m("a", O, has_work=True, oldest_arrival=0.0)]

    assert PrismPolicy().turn(states) is None and StaticPolicy().turn(states) is None
    assert read == []
    assert SwapPolicy().turn(states) == {"a"}


def test_reserves_move_in_the_balloons_order_under_prism_and_swap():
    owners = [Owner("a", 3, 7), Owner("b", 2, 2)]
    for p in (PrismPolicy(), SwapPolicy()):
        assert p.reclaim_order(owners, "x", frozenset({"b"})) == ["a", "b"]


def test_an_offloaded_model_activates_only_when_no_other_model_takes():
    assert may_activate("a", None)
    assert may_activate("a", "a")
    assert not may_activate("a", "b")
