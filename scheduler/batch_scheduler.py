"""Per-model continuous batching: waiting/running queues, chunked prefill under a token budget,
decode, and preemption by recompute when blocks run out.

One scheduling rule covers prefill, decode, chunked prefill and recompute after preemption: each
request has `num_tokens` (prompt + output so far) and `num_computed_tokens` (K/V cached); a step
computes up to `num_tokens - num_computed_tokens` of its tokens within the step's token budget.
Running requests go first, in admission order; when blocks run out, the most recently admitted
running request is preempted (blocks freed, back to the front of the waiting queue, recomputed
later). Waiting requests are admitted while budget, sequence slots and blocks allow: FCFS, or in
the order the device's arbitrator gives (and only those it names). The step's token budget may
be smaller than the configured one when the arbitrator chunks a prefill.

Pure decision code: blocks come through the `BlockPool` protocol (the kvpool allocator satisfies
it), and the time is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
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

    def can_allocate(self, n: int) -> bool:
        """Whether n more blocks could be had now."""

    def free(self, blocks: list[int]) -> None: ...


class PrefixBlocks(Protocol):
    """A block pool that caches full blocks by content (the kvpool allocator's prefix cache)."""

    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest prefix of tokens (at most max_blocks), taken."""

    def commit(self, blocks: list[int], tokens: list[int], first: int, end: int) -> None:
        """Blocks first..end-1 of a request's table are full: cache them."""


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64  # requests in one batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step
    max_model_len: int = 4096
    # admission reserves KV for this many of each request's output tokens (capped at its
    # max_tokens), for the running ones too, so that admitted work rarely needs preemption; 0:
    # admit while the prompt fits (vLLM's greedy admission, preempting when blocks run out)
    reserve_output_tokens: int = 0
    # a new request starts from the longest cached prefix of its tokens (the pool's `prefix`)
    enable_prefix_caching: bool = False

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
    def __init__(
        self, config: SchedulerConfig, blocks: BlockPool, prefix: PrefixBlocks | None = None
    ):
        """prefix: the cache of full blocks, with config.enable_prefix_caching."""
        self.config = config
        self.blocks = blocks
        self.prefix = prefix if config.enable_prefix_caching else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.recomputed_tokens = 0  # since start: computed tokens preemptions threw away
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens of new requests / found cached
        self.tokens_computed = 0  # since start: tokens whose K/V the steps computed
        self.admitting = True  # False while the model drains: waiting requests stay queued
        self.blocked = False  # the last step left a request waiting for blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def blocks_to_start(self, req: Request) -> int:
        """The free blocks `req` needs to start now: its tokens' and its first output's, or
        under a reserve (reserve_output_tokens) its prompt's and reserved output's beside what
        the running requests still reserve (admission's own test)."""
        if self.config.reserve_output_tokens:
            return self._reserved() + self._future_blocks(req)
        return max(self.blocks_needed(req.num_tokens + 1) - len(req.block_table), 0)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever hold its KV (all pages mapped)."""
        return self.blocks_needed(num_tokens) <= self.blocks.capacity_blocks

    # ---- one step -----------------------------------------------------------------------------
    def schedule(
        self, now: float, admit: Sequence[str] | None = None, token_budget: int | None = None
    ) -> list[ScheduledChunk]:
        """This step's chunks. admit: the waiting request ids that may start, in order (None:
        all, FCFS); token_budget: at most this many tokens (None: max_num_batched_tokens)."""
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = max(1, min(budget, token_budget))
        self.blocked = False
        out: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.grow(req, req.num_computed_tokens + num_new):
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
        if preempted:
            self.blocked = True
        reserved = self._reserved() if self.config.reserve_output_tokens else 0
        for req in self._candidates(admit):
            if (
                not self.admitting
                or budget <= 0
                or preempted
                or len(self.running) >= self.config.max_num_seqs
            ):
                break
            self._reuse_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.config.reserve_output_tokens:
                mine = self._future_blocks(req)
                if not self.blocks.can_allocate(reserved + mine):
                    self._unadmit(req)
                    break
            if not self.grow(req, req.num_computed_tokens + num_new):
                self._unadmit(req)
                break
            if self.config.reserve_output_tokens:
                reserved += self._future_blocks(req)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                if self.prefix is not None:
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += req.num_cached_tokens
            self.running.append(req)
            out.append(ScheduledChunk.of(req, num_new))
            budget -= num_new
        return out

    def _unadmit(self, req: Request) -> None:
        """A request that could not start after all: the cached blocks it took go back, and
        the step is blocked on memory."""
        self._release(req)
        req.num_computed_tokens = 0
        self.blocked = True

    def _reuse_prefix(self, req: Request) -> None:
        """A request about to start (or recompute) takes the cached blocks of its longest
        cached prefix and computes only the rest (one token at least: its logits). Not for one
        that wants its prompt's logprobs: they come from computing every position."""
        if self.prefix is None or req.block_table or req.params.prompt_logprobs is not None:
            return
        if req.adapter is not None:  # its K/V are its adapter's: cached by token ids they'd lie
            return
        hit = self.prefix.match(req.all_token_ids, (req.num_tokens - 1) // self.config.block_size)
        req.block_table = hit
        req.num_computed_tokens = len(hit) * self.config.block_size
        if req.first_scheduled_time is None:  # what the usage reports
            req.num_cached_tokens = req.num_computed_tokens

    def _future_blocks(self, req: Request) -> int:
        """Blocks req will still take for its prompt and its reserved output."""
        out = min(req.params.max_tokens, self.config.reserve_output_tokens)
        target = max(req.num_prompt_tokens + out, req.num_tokens)
        return max(self.blocks_needed(target) - len(req.block_table), 0)

    def _reserved(self) -> int:
        return sum(self._future_blocks(r) for r in self.running)

    def _candidates(self, admit: Sequence[str] | None) -> Iterator[Request]:
        if admit is None:  # FCFS: the head, as long as the caller admits it
            while self.waiting:
                yield self.waiting[0]
            return
        by_id = {r.request_id: r for r in self.waiting}
        yield from (by_id[k] for k in admit if k in by_id)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Whether req holds the blocks of num_tokens tokens, taking what it lacks (none if they
        cannot all be had)."""
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
        lost, req.num_computed_tokens = req.num_computed_tokens, 0  # computed again later
        req.recomputed_tokens += lost
        self.recomputed_tokens += lost
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def preempt(self, req: Request) -> None:
        """One running request back to the front of the waiting queue, its blocks freed (it
        recomputes later): the balloon's last resort for another model's new work."""
        self.running.remove(req)
        self._preempt(req)

    @property
    def has_new_work(self) -> bool:
        """Whether a request that never ran waits (not a preempted one's recompute)."""
        return any(r.first_scheduled_time is None for r in self.waiting)

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
    def advance(self, batch: list[ScheduledChunk]) -> None:
        """The step ran: each chunk's tokens now have their K/V in the cache (and the blocks
        they filled are cached)."""
        bs = self.config.block_size
        for c in batch:
            req = c.request
            if req.is_finished:  # ended while its step ran (a stop string): its blocks are gone
                continue
            req.num_computed_tokens = c.start + c.num_new
            self.tokens_computed += c.num_new
            full = req.num_computed_tokens // bs > c.start // bs
            if self.prefix is not None and full and req.adapter is None:
                self.prefix.commit(
                    req.block_table, req.all_token_ids, c.start // bs, req.num_computed_tokens // bs
                )

    def finish(self, req: Request) -> None:
        """Remove a finished (or aborted) request wherever it is and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
