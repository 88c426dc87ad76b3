"""A short, bounded profile of one model's steps on its device, for its latency model.

Runs synthetic prefill and decode steps of growing size through the model's own runner (CUDA
graphs included, so decode is measured as it will run) over blocks borrowed from its KV cache,
and returns the measured (shape, seconds) pairs. It stops at the time budget, skips a shape the
pool has no blocks for, and gives every block back. The content of the KV cache is garbage while
it runs, which is fine: only the timing is kept and the blocks are freed."""

from __future__ import annotations

import time

import torch

from prism_server.engine.model_runner import ModelRunner
from scheduler.batch_scheduler import BatchScheduler, ScheduledChunk
from scheduler.latency_model import LatencyModel, StepShape
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

_PARAMS = SamplingParams(max_tokens=1)
_RUNS = 3  # per shape; the best counts


def _shapes(max_tokens: int, max_seqs: int, max_len: int) -> list[tuple[str, int, int]]:
    """(kind, a, b), cheapest first: ("prefill", tokens, cached) or ("decode", batch, context)."""
    out = []
    for kind, a, b in (
        ("decode", 1, 128),
        ("prefill", 16, 0),
        ("decode", 8, 256),
        ("prefill", 128, 0),
        ("decode", 1, 2048),
        ("prefill", 512, 0),
        ("decode", 32, 512),
        ("prefill", 256, 1024),
        ("decode", 64, 1024),
        ("prefill", 2048, 0),
        ("decode", 16, 4096),
        ("prefill", 1024, 6144),  # a late chunk of a long prompt: attention dominates more
    ):
        if kind == "prefill":
            a = min(a, max_tokens, max_len - b - 1)
        else:
            a, b = min(a, max_seqs), min(b, max_len - 1)
        if a >= 1 and (kind, a, b) not in out:
            out.append((kind, a, b))
    return out


def profile_steps(
    runner: ModelRunner, scheduler: BatchScheduler, budget_s: float
) -> list[tuple[StepShape, float]]:
    cfg = scheduler.config
    device = runner.device
    samples: list[tuple[StepShape, float]] = []
    fit = LatencyModel()
    started = time.perf_counter()
    for kind, a, b in _shapes(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len):
        if kind == "prefill":
            lens, new = [(b + a, b)], a  # (tokens in all, cached)
        else:
            lens, new = [(b + 1, b)] * a, 1
        shape = StepShape.of((cached, new) for _, cached in lens)
        # stop before a shape that the samples so far say would overrun the budget
        if time.perf_counter() - started + _RUNS * fit.estimate(shape) > budget_s:
            break
        reqs = [
            Request(f"profile{i}", [1] * n, _PARAMS, frozenset(), 0.0)
            for i, (n, _) in enumerate(lens)
        ]
        taken: list[int] = []
        try:
            ok = True
            for r, (n, cached) in zip(reqs, lens):
                blocks = scheduler.blocks.allocate(scheduler.blocks_needed(n))
                if blocks is None:
                    ok = False
                    break
                r.block_table = blocks
                taken.extend(blocks)
                r.num_computed_tokens = cached
            if not ok:
                continue
            batch = [ScheduledChunk.of(r, new) for r in reqs]
            best = float("inf")
            for _ in range(_RUNS):  # the first warms up (graphs, allocator, caches)
                t = time.perf_counter()
                runner.execute(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t)
            samples.append((shape, best))
            fit.fit_profile(samples)
        finally:
            if taken:
                scheduler.blocks.free(taken)
    return samples
