"""Batch scheduling over a block pool, without a model (and without torch)."""

from __future__ import annotations

from scheduler.batch_scheduler import BatchScheduler, SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams

BLOCK = 4


class Blocks:
    """A block pool of `pages` pages of `blocks_per_page` blocks each, as plain Python: the
    scheduler sees only the BlockPool protocol, so its tests need no torch and no kvpool."""

    def __init__(self, pages: int, blocks_per_page: int):
        self.capacity_blocks = pages * blocks_per_page
        self.free_ids = list(range(self.capacity_blocks, 0, -1))
        self.used: set[int] = set()

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        out = [self.free_ids.pop() for _ in range(n)]
        self.used.update(out)
        return out

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def free(self, blocks: list[int]) -> None:
        assert self.used.issuperset(blocks), "freed a block that is not in use"
        self.used.difference_update(blocks)
        self.free_ids.extend(blocks)

    def check_integrity(self) -> None:
        assert len(self.used) + len(self.free_ids) == self.capacity_blocks
        assert not self.used & set(self.free_ids)


def make(pages: int, blocks_per_page: int = 4, **cfg):
    kv = Blocks(pages, blocks_per_page)
    return BatchScheduler(SchedulerConfig(block_size=BLOCK, **cfg), kv), kv


def req(n: int, name: str) -> Request:
    return Request(name, list(range(1, n + 1)), SamplingParams(max_tokens=64), frozenset(), 0.0)


def run_step(s: BatchScheduler):
    """Schedules and pretends the model ran: every sampling chunk gets one new token."""
    batch = s.schedule(now=1.0)
    s.advance(batch)
    for c in batch:
        if c.samples:
            c.request.append_token(7)
    return [(c.request.request_id, c.num_new) for c in batch]


def test_chunked_prefill_splits_prompts_under_the_token_budget():
    s, kv = make(pages=16, max_num_batched_tokens=10)
    a, b = req(14, "a"), req(5, "b")
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 10)]
    assert a.num_output_tokens == 0  # a prefill chunk that does not reach the end samples nothing
    assert run_step(s) == [("a", 4), ("b", 5)]
    assert run_step(s) == [("a", 1), ("b", 1)]  # both decode
    for r in (a, b):
        s.finish(r)
    kv.check_integrity()


def test_max_num_seqs_caps_the_running_set():
    s, kv = make(pages=16, max_num_seqs=2)
    rs = [req(3, f"r{i}") for i in range(3)]
    for r in rs:
        s.add(r)
    assert [x for x, _ in run_step(s)] == ["r0", "r1"]
    assert rs[2].status is RequestStatus.WAITING
    s.finish(rs[0])
    assert [x for x, _ in run_step(s)] == ["r1", "r2"]
    for r in rs[1:]:
        s.finish(r)
    kv.check_integrity()


def test_preemption_by_recompute_when_blocks_run_out():
    s, kv = make(pages=2, blocks_per_page=2)  # 4 blocks = 16 tokens in all
    a, b = req(7, "a"), req(7, "b")  # 2 blocks each, full after one decode step
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 7), ("b", 7)]
    assert run_step(s) == [("a", 1), ("b", 1)]  # positions 7 fit in block 2
    # the next token of each needs a third block: b (admitted last) is preempted for a
    assert run_step(s) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert b.num_preemptions == 1 and s.waiting[0] is b
    assert b.num_output_tokens == 2  # its outputs are kept and recomputed later
    kv.check_integrity()
    s.finish(a)
    assert run_step(s) == [("b", 9)]  # prompt + 2 outputs recomputed in one chunk
    s.finish(b)
    kv.check_integrity()


def test_a_request_alone_that_cannot_grow_waits_instead_of_failing():
    s, kv = make(pages=1, blocks_per_page=2)  # 8 tokens in all
    a = req(8, "a")
    s.add(a)
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == []  # needs a 3rd block: preempts itself, stays queued
    assert a.status is RequestStatus.WAITING and s.has_work
    s.finish(a)
    kv.check_integrity()


def test_the_first_admission_time_is_the_time_passed_in():
    s, kv = make(pages=4)
    a = req(3, "a")
    s.add(a)
    s.schedule(now=12.5)
    assert a.first_scheduled_time == 12.5
    s.schedule(now=13.0)  # still running: the first time stays
    assert a.first_scheduled_time == 12.5
    s.finish(a)
    kv.check_integrity()


def test_fits_is_against_every_block_the_pool_can_address():
    s, kv = make(pages=2, blocks_per_page=2)  # 4 blocks of 4 tokens
    assert s.fits(16) and not s.fits(17)
    kv.check_integrity()


def _drain(s: BatchScheduler, max_tokens: int) -> int:
    """Runs steps until every request has max_tokens outputs (finishing them); returns the most
    requests that ran at once."""
    most = 0
    while s.has_work:
        run_step(s)
        most = max(most, len(s.running))
        for r in list(s.running):
            if r.num_output_tokens >= max_tokens:
                s.finish(r)
    return most


def test_reserving_the_output_admits_only_what_can_finish_without_preemption():
    # 8 pages of 4 blocks of 4 tokens = 128 tokens; each request: 8 prompt + 24 output = 32
    for reserve, preempts in ((0, True), (64, False)):
        s, kv = make(pages=8, reserve_output_tokens=reserve)
        for i in range(8):
            r = Request(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=24), frozenset(), 0)
            s.add(r)
        most = _drain(s, 24)
        assert (s.num_preemptions > 0) is preempts, (reserve, s.num_preemptions)
        if reserve:
            assert most == 4  # 4 x 32 tokens fill the pool exactly
        kv.check_integrity()
        assert not kv.used


def test_blocks_to_start_is_what_admission_asks_for():
    """The balloon asks the pool for what the scheduler's admission will test: without a
    reserve a request's tokens and one more (its first output's, so that it does not stop at
    once), with one its reserved output beside what the running requests still reserve."""
    for reserve, want in ((0, 3), (64, 8)):  # 8 + 1 tokens: 3 blocks; 8 + 24: 8
        s, _ = make(pages=8, reserve_output_tokens=reserve)
        s.add(Request("a", list(range(1, 9)), SamplingParams(max_tokens=24), frozenset(), 0))
        assert s.blocks_to_start(s.waiting[0]) == want
        run_step(s)
        s.add(Request("b", list(range(1, 9)), SamplingParams(max_tokens=24), frozenset(), 0))
        held = 8 - len(s.running[0].block_table) if reserve else 0  # a's output to come
        assert s.blocks_to_start(s.waiting[0]) == want + held
        tight = want - (1 if reserve else 2)  # (without a reserve: 8 tokens prefill in 2)
        for blocks, starts in ((tight, False), (want, True)):
            s, kv = make(pages=blocks, blocks_per_page=1, reserve_output_tokens=reserve)
            s.add(Request("c", list(range(1, 9)), SamplingParams(max_tokens=24), frozenset(), 0))
            assert s.blocks_to_start(s.waiting[0]) == want
            assert bool(s.schedule(now=1.0)) is starts
            kv.check_integrity()
