"""The arbitrator: Moore-Hodgson admission against brute force, EDF order, no starvation,
determinism, model choice and prefill chunking."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler.arbitrator import Job, ModelWork, Running, arbitrate, moore_hodgson
from scheduler.latency_model import LatencyModel
from scheduler.request import MAX_GAP_SLOS, TPOT_MARGIN


def _feasible(jobs: list[Job], start: float) -> bool:
    t = start
    for j in sorted(jobs, key=lambda j: j.deadline):
        t += j.duration
        if t > j.deadline + 1e-12:
            return False
    return True


def _brute_force(jobs: list[Job], start: float) -> int:
    for k in range(len(jobs), -1, -1):
        if any(_feasible(list(c), start) for c in itertools.combinations(jobs, k)):
            return k
    return 0


def _random_jobs(rng: random.Random, n: int, models: int = 3) -> list[Job]:
    return [
        Job(
            key=f"j{i}",
            model=f"m{rng.randrange(models)}",
            arrival=rng.uniform(0, 1),
            deadline=rng.uniform(0.5, 4.0),
            duration=rng.choice([0.1, 0.25, 0.5, 1.0]) * rng.uniform(0.5, 2),
            priority=rng.randrange(2),
        )
        for i in range(n)
    ]


def test_moore_hodgson_admits_as_many_on_time_as_the_brute_force_optimum():
    rng = random.Random(7)
    for _ in range(1200):
        jobs = _random_jobs(rng, rng.randint(0, 7))
        start = rng.uniform(0, 1)
        kept, late = moore_hodgson(jobs, start)
        assert sorted(j.key for j in kept + late) == sorted(j.key for j in jobs)
        assert _feasible(kept, start), "an admitted request would be late"
        assert len(kept) == _brute_force(jobs, start)


def test_admitted_requests_are_in_deadline_order_with_priority_breaking_ties():
    rng = random.Random(3)
    for _ in range(300):
        jobs = _random_jobs(rng, rng.randint(1, 12))
        kept, late = moore_hodgson(jobs, 0.0)
        for seq in (kept, late):
            keys = [(j.deadline, j.priority, j.arrival) for j in seq]
            assert keys == sorted(keys)
    tie = [Job("a", "m", 0.0, 1.0, 0.1, priority=1), Job("b", "m", 0.5, 1.0, 0.1, priority=0)]
    assert [j.key for j in moore_hodgson(tie, 0.0)[0]] == ["b", "a"]


def test_the_longest_request_is_dropped_to_save_the_others():
    jobs = [
        Job("short1", "m", 0, deadline=1.0, duration=0.3),
        Job("long", "m", 0, deadline=1.1, duration=0.9),
        Job("short2", "m", 0, deadline=1.2, duration=0.3),
    ]
    kept, late = moore_hodgson(jobs, 0.0)
    assert [j.key for j in kept] == ["short1", "short2"] and [j.key for j in late] == ["long"]


def _lat(step_s: float = 0.01, per_token: float = 1e-4) -> LatencyModel:
    return LatencyModel((step_s, per_token, 0.0, 0.0))


def _work(name, jobs=(), running: Running | None = None, lat=None, max_tokens=2048):
    return ModelWork(name, lat or _lat(), running or Running(), tuple(jobs), max_tokens=max_tokens)


def _job(key, model, arrival, deadline, tokens, lat=None, priority=0):
    return Job(
        key, model, arrival, deadline, (lat or _lat()).prefill_s(tokens), priority, 0, tokens
    )


def test_pick_is_deterministic_whatever_the_input_order():
    rng = random.Random(11)
    for _ in range(200):
        names = [f"m{i}" for i in range(rng.randint(1, 4))]
        works = []
        for n in names:
            jobs = [
                _job(f"{n}-{k}", n, rng.uniform(0, 1), rng.uniform(0.5, 3), rng.randint(1, 4000))
                for k in range(rng.randint(0, 4))
            ]
            run = (
                Running(
                    decode_deadline=rng.uniform(1, 1.2),
                    ready_since=rng.uniform(0, 1),
                    num=rng.randint(1, 8),
                    context_tokens=500,
                )
                if rng.random() < 0.5
                else Running()
            )
            works.append(_work(n, jobs, run))
        a = arbitrate(works, 1.0)
        shuffled = [
            _work(w.name, rng.sample(list(w.waiting), len(w.waiting)), w.running) for w in works
        ]
        rng.shuffle(shuffled)
        assert arbitrate(shuffled, 1.0) == a


def test_nothing_starves_every_request_is_admitted_in_bounded_time():
    """A device simulated step by step: whatever is admitted is prefilled (its estimated time),
    decodes run; with arrivals over, every request gets admitted, the late ones too."""
    rng = random.Random(5)
    for _ in range(100):
        lat = _lat()
        names = [f"m{i}" for i in range(3)]
        waiting = {
            n: [
                _job(f"{n}-{k}", n, 0.0, rng.uniform(0.05, 0.5), rng.randint(10, 3000), lat)
                for k in range(rng.randint(0, 6))
            ]
            for n in names
        }
        total = sum(len(v) for v in waiting.values())
        bound = sum(j.duration for v in waiting.values() for j in v) + 0.01 * total + 1.0
        now, admitted = 0.0, 0
        for _ in range(10 * total + 10):
            pick = arbitrate([_work(n, waiting[n], lat=lat) for n in names], now)
            if pick is None:
                break
            assert pick.admit, "a pick with nothing to run"
            key = pick.admit[0]
            j = next(j for j in waiting[pick.model] if j.key == key)
            waiting[pick.model].remove(j)
            now += j.duration
            admitted += 1
        assert admitted == total and now <= bound


def test_a_light_load_is_served_in_arrival_order_across_models():
    a = _work("a", [_job("a1", "a", 0.2, 10.0, 100)])
    b = _work("b", [_job("b1", "b", 0.1, 10.0, 100)])
    assert arbitrate([a, b], 0.3).model == "b"


def test_a_decode_about_to_be_late_runs_before_an_older_prefill():
    lat = _lat(step_s=0.01)
    prefill = _work("p", [_job("p1", "p", 0.0, 10.0, 4000, lat)], lat=lat)
    # its next token is due in 15 ms: the 0.41 s prefill first would make it late
    decoding = _work(
        "d",
        running=Running(decode_deadline=1.015, ready_since=0.9, num=4, context_tokens=100),
        lat=lat,
    )
    pick = arbitrate([prefill, decoding], 1.0)
    assert pick.model == "d"


def test_a_long_prompt_is_chunked_so_the_other_models_decodes_stay_on_time():
    lat = _lat(step_s=0.005, per_token=1e-4)  # 2048 tokens: 0.21 s
    prefill = _work("p", [_job("p1", "p", 0.0, 1.9, 8000, lat)], lat=lat)
    decoding = _work(
        "d",
        running=Running(decode_deadline=1.05, ready_since=1.0, num=4, context_tokens=100),
        lat=lat,
    )
    pick = arbitrate([prefill, decoding], 1.0)
    assert pick.model == "p"  # it waited longest, and a chunk of it leaves d on time
    # the chunk must leave d its 50 ms less its own 5 ms step
    assert 16 <= pick.token_budget <= (0.045 - 0.005) / 1e-4 + 1
    alone = arbitrate([prefill], 1.0)
    assert alone.token_budget == 2048


def test_deferred_requests_wait_while_another_models_on_time_request_waits():
    lat = _lat(step_s=0.01)
    hopeless = _job("late", "a", 0.0, 0.05, 4000, lat)  # 0.41 s of prefill, due in 50 ms
    on_time = _job("ok", "b", 0.0, 5.0, 100, lat)
    pick = arbitrate([_work("a", [hopeless], lat=lat), _work("b", [on_time], lat=lat)], 0.0)
    assert pick.model == "b" and pick.admit == ("ok",) and pick.deferred == ("late",)
    alone = arbitrate([_work("a", [hopeless], lat=lat)], 0.0)
    assert alone.admit == ("late",), "with nothing on time elsewhere it runs (work conserving)"


def test_a_deferred_request_is_not_starved_behind_another_models_decodes():
    lat = _lat(step_s=0.01)
    hopeless = _job("late", "a", 0.0, 0.05, 4000, lat)  # deferred: it cannot be on time
    # b decodes with plenty of slack, and will again after every step: a must still get its turn
    decoding = Running(decode_deadline=1.5, ready_since=0.9, num=4, context_tokens=4096)
    pick = arbitrate([_work("a", [hopeless], lat=lat), _work("b", running=decoding, lat=lat)], 1.0)
    assert pick.model == "a" and pick.admit == ("late",)
    # unless b's next token is due before another step can run: then b goes first
    due = Running(decode_deadline=1.012, ready_since=0.9, num=4, context_tokens=4096)
    pick = arbitrate([_work("a", [hopeless], lat=lat), _work("b", running=due, lat=lat)], 1.0)
    assert pick.model == "b"


def test_a_stream_that_cannot_catch_up_takes_its_turn_like_late_work():
    lat = _lat(step_s=0.01)
    hopeless = _job("late", "a", 0.0, 0.05, 4000, lat)

    def b(slo: float, ready_since: float = 0.99) -> ModelWork:
        # b's mean TPOT is behind: its deadline passed
        behind = Running(
            decode_deadline=0.9,
            decode_gap_deadline=ready_since + MAX_GAP_SLOS * slo,
            tpot_slo=slo,
            ready_since=ready_since,
            num=4,
            context_tokens=64,
        )
        return _work("b", running=behind, lat=lat)

    # its ~10 ms step is slower than its 8 ms SLO: it cannot catch up, and a's request has
    # waited longer: a goes, its prefill unbounded by b's lost deadlines
    pick = arbitrate([_work("a", [hopeless], lat=lat), b(0.008)], 1.0)
    assert pick.model == "a" and pick.admit == ("late",) and pick.token_budget == 2048
    # b's work waited longer: b goes
    assert (
        arbitrate(
            [_work("a", [_job("x", "a", 0.5, 0.55, 100, lat)], lat=lat), b(0.008, 0.4)], 1.0
        ).model
        == "b"
    )
    # with a 50 ms SLO, stepping it catches up: its mean keeps it first
    assert arbitrate([_work("a", [hopeless], lat=lat), b(0.05)], 1.0).model == "b"


def test_a_stream_the_device_cannot_keep_up_with_does_not_starve_another_model():
    """b's decode step takes longer than its TPOT SLO: its mean falls further behind with every
    step. a's request arrives and is late at once; it must run next, not after b's whole
    stream."""
    slo, step = 0.02, 0.03
    lat = _lat(step_s=step, per_token=1e-6)
    now, first, n = 0.0, 0.0, 1
    job = _job("late", "a", 0.5, 0.51, 100, lat)
    for _ in range(1000):
        cap = now + MAX_GAP_SLOS * slo
        b = Running(
            decode_deadline=min(first + n * slo * (1 - TPOT_MARGIN), cap),  # Request.deadline
            decode_gap_deadline=cap,
            tpot_slo=slo,
            ready_since=now,
            num=1,
            context_tokens=64,
        )
        works = [_work("b", running=b, lat=lat)]
        if now >= job.arrival:
            works.append(_work("a", [job], lat=lat))
        pick = arbitrate(works, now)
        if pick.model == "a":
            break
        now, n = now + step, n + 1
    assert pick.model == "a" and pick.admit == ("late",)
    assert now < job.arrival + step


def test_a_late_prefill_of_its_own_does_not_shrink_the_chunk():
    lat = _lat(step_s=0.005, per_token=1e-4)
    # its own request in prefill is past its TTFT deadline; nothing decodes anywhere
    late = Running(ready_since=0.0, prefills=((0.5, 4000, 0, lat.prefill_s(4000)),))
    pick = arbitrate([_work("p", running=late, lat=lat)], 1.0)
    assert pick.token_budget == 2048


def test_committed_prefills_delay_the_jobs_behind_them_and_are_never_dropped():
    """A prefill in progress (fixed) takes its place in the deadline order and its time; it is
    never dropped or judged late, even when it is late itself."""
    late_fixed = Job("p", "m", -1.0, deadline=0.1, duration=0.5)  # past due, still runs
    a = Job("a", "m", 0.0, deadline=0.7, duration=0.3)
    b = Job("b", "n", 0.0, deadline=1.0, duration=0.3)
    kept, late = moore_hodgson([a, b], 0.0)
    assert [j.key for j in kept] == ["a", "b"] and not late
    kept, late = moore_hodgson([a, b], 0.0, fixed=[late_fixed])
    # 0.5 of committed work first: a would end at 0.8 > 0.7, the longest droppable goes
    assert [j.key for j in late] == ["a"] and [j.key for j in kept] == ["b"]
    # every job of the brute-force optimum stays on time behind the fixed work
    rng = random.Random(5)
    for _ in range(200):
        jobs = _random_jobs(rng, 6)
        fixed = [Job("f", "m0", -1.0, rng.uniform(0, 3), rng.uniform(0.05, 0.5))]
        kept, late = moore_hodgson(jobs, 0.0, fixed)
        assert sorted(j.key for j in kept + late) == sorted(j.key for j in jobs)
        t = 0.0
        for j in sorted(kept + fixed, key=lambda j: (j.deadline, j.priority, j.arrival, j.key)):
            t += j.duration
            assert j in fixed or t <= j.deadline + 1e-9


def test_a_prompt_longer_than_a_step_is_estimated_in_its_chunks():
    """A 6144-token prompt under a 2048-token step runs in three steps, each paying the step's
    fixed costs: the arbitrator's estimate of it (a waiting job, or a prefill in progress) is
    the three chunks', not one 6144-token step's."""
    from scheduler.arbitrator import model_work
    from scheduler.request import Request
    from scheduler.sampling_params import SamplingParams

    lat = LatencyModel((2e-3, 3e-5, 1e-4, 1e-9, 1e-8, 15e-3))  # 15 ms a prefill step
    one = lat.prefill_s(6144)
    chunks = lat.prefill_s(2048) + lat.prefill_s(2048, 2048) + lat.prefill_s(2048, 4096)
    assert lat.chunked_prefill_s(6144, 0, 2048) == pytest.approx(chunks)
    assert chunks - one == pytest.approx(2 * (2e-3 + 1e-4 + 15e-3), rel=1e-4)
    assert lat.chunked_prefill_s(100, 0, 2048) == lat.prefill_s(100)

    from tests.scheduler.test_batch_scheduler import make

    sched, kv = make(pages=512, max_num_batched_tokens=2048, max_model_len=8192)
    r = Request("r", list(range(6144)), SamplingParams(max_tokens=4), frozenset(), 0.0)
    sched.add(r)
    (job,) = model_work("m", sched, lat).waiting
    assert job.duration == pytest.approx(chunks)
    batch = sched.schedule(0.0)  # its first chunk runs: 4096 tokens in two chunks are left
    assert [c.num_new for c in batch] == [2048]
    sched.advance(batch)
    ((_, todo, cached, seconds),) = model_work("m", sched, lat).running.prefills
    assert (todo, cached) == (4096, 2048)
    assert seconds == pytest.approx(lat.prefill_s(2048, 2048) + lat.prefill_s(2048, 4096))
    sched.finish(r)
    kv.check_integrity()
