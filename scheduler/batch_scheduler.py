"""Per-model continuous batching: waiting/running queues, chunked prefill under a token budget,
decode, and preemption by recompute when blocks run out.

One scheduling rule covers prefill, decode, chunked prefill and recompute after preemption: each
request has `num_tokens` (prompt + output so far) and `num_computed_tokens` (K/V cached); a step
computes up to `num_tokens - num_computed_tokens` of its tokens within the step's token budget.
Running requests go first, in admission order; when blocks run out, the most recently admitted
running request is preempted (blocks freed, back to the front of the waiting queue, recomputed
later). Waiting requests are admitted FCFS while budget, sequence slots and blocks allow.

Pure decision code: blocks come through the `BlockPool` protocol (the kvpool allocator satisfies
it), and the time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from scheduler.request import Request, RequestStatus


class BlockPool(Protocol):
    """Where KV blocks come from (one model's allocator)."""

    @property
    def capacity_blocks(self) -> int:
        """Blocks the model could hold if it had every page it can address."""

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, or None with nothing taken."""

    def free(self, blocks: list[int]) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64  # requests in one batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step
    max_model_len: int = 4096

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # the request's num_computed_tokens when scheduled
    num_new: int  # tokens computed this step, from `start`

    @classmethod
    def of(cls, req: Request, num_new: int) -> ScheduledChunk:
        return cls(req, req.num_computed_tokens, num_new)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so the step samples a token."""
        return self.start + self.num_new == self.request.num_tokens


class BatchScheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockPool):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.admitting = True  # False while the model drains: waiting requests stay queued

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever hold its KV (all pages mapped)."""
        return self.blocks_needed(num_tokens) <= self.blocks.capacity_blocks

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(ScheduledChunk.of(req, num_new))
                budget -= num_new
                i += 1
                continue
            break
        while (
            self.admitting
            and self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            out.append(ScheduledChunk.of(req, num_new))
            budget -= num_new
        return out

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks_needed(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self.blocks.allocate(need)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def preempt_all(self) -> int:
        """Every running request back to the front of the waiting queue, in admission order, its
        blocks freed (it recomputes later); returns how many."""
        n = len(self.running)
        while self.running:
            self._preempt(self.running.pop())
        return n

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.blocks.free(req.block_table)
            req.block_table = []

    # ---- after the step -----------------------------------------------------------------------
    @staticmethod
    def advance(batch: list[ScheduledChunk]) -> None:
        """The step ran: each chunk's tokens now have their K/V in the cache."""
        for c in batch:
            c.request.num_computed_tokens = c.start + c.num_new

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request wherever it is and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
