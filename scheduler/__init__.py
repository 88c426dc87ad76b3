"""scheduler: the pure decision layer. Plain data in, decisions out, the time passed in; no torch,
no kvpool, no I/O (import-linter enforces it), so every policy is tested exhaustively on CPU."""

from scheduler.balloon import reclaim_order
from scheduler.batch_scheduler import BatchScheduler, BlockPool, ScheduledChunk, SchedulerConfig
from scheduler.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from scheduler.sampling_params import SamplingParams
from scheduler.snapshot import DeviceSnapshot, ModelSnapshot, PoolSnapshot, Residency

__all__ = [
    "BatchScheduler",
    "BlockPool",
    "DeviceSnapshot",
    "FinishReason",
    "ModelSnapshot",
    "PoolSnapshot",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Residency",
    "SamplingParams",
    "ScheduledChunk",
    "SchedulerConfig",
    "TokenLogprob",
    "reclaim_order",
]
