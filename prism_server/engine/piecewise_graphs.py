"""Piecewise CUDA graphs for the steps a decode graph cannot run: prefill chunks, mixed batches,
decode batches past the largest decode graph.

An eager forward launches every kernel through Python: for an 8B model that is about 1,500
launches a step, some 10-18 ms of host time on the H200, whatever the step's size. So a small
prefill step costs three times its device time. Here everything between two attention calls
(embedding, norms, projections, rope, MLPs, the final norm) is captured once per token bucket,
one graph per segment: num_layers + 1 graphs per bucket. A step of T tokens replays the smallest
bucket >= T. Between the graphs, attention runs eagerly, planned for the step's own batch. It
reads q/k/v from static buffers (the segment before it puts them there) and writes its output
into a static buffer that the next segment reads. Padded rows (T..bucket) compute rows that
nothing reads: every op between attention calls works row by row.

With kv_views, each segment also writes its layer's K/V at the slots of a static buffer,
refilled each step (padded rows write the null block, as in decode graphs), so the eager part
of a step is the attention kernels alone. Where Triton runs, one kernel per layer rotates q
and k into the static buffers, puts v beside them and stores K/V (triton_ops.rope_write); else
the model's rope, copies of q, k and v and an indexed store.

All buckets share one memory pool (the device's graph pool) and never replay concurrently; each
bucket's replays are self-contained (nothing of one step's replay is read by another's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.attention.base import ForwardContext, LayerAttention
from models.attention.kv_write import KVSlots, write_kv
from models.kernels import triton_ops
from prism_server.engine import cuda_graph_runner

log = logging.getLogger(__name__)

# a 1k-token prompt through the graphs took 2.4-2.9% less TTFT than eagerly on an H100
# (docs/BENCHMARKS.md); past that the device time dwarfs the launches
DEFAULT_MAX_TOKENS = 1024


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The step sizes captured for steps of up to max_tokens: powers of two from 8 to 512, then
    every 256 tokens (a step replays the smallest bucket at least its size: padded rows cost
    GEMM time, so the large buckets are close together); () if max_tokens < 8."""
    small = [n for n in (8, 16, 32, 64, 128, 256, 512) if n <= max_tokens]
    large = list(range(768, max_tokens + 1, 256))
    top = [max_tokens] if max_tokens >= 8 and max_tokens not in small + large else []
    return tuple(small + large + top)


DEFAULT_TOKEN_BUCKETS = token_buckets(DEFAULT_MAX_TOKENS)


@dataclass
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]  # num_layers + 1 segments
    layers: list[tuple[int, LayerAttention]]  # the attention call after each segment but the last
    hidden: torch.Tensor  # [bucket, hidden]: the last segment's output (static)
    at: KVSlots | None  # where the segments write K/V (static), with kv_views


class _SegmentHook:
    """The attention backend of a capture: at each attention call, the segment captured so far
    ends (after copying q/k/v to the static buffers) and the next one begins; the call returns
    the static output buffer. In the warm-up run (capturing False) it only copies."""

    def __init__(self, owner: PiecewiseGraphs, capturing: bool):
        self.owner, self.capturing = owner, capturing
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple[int, LayerAttention]] = []
        self.at: KVSlots | None = None  # made by the first segment, read by all

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        pool = self.owner.pool
        g.capture_begin(pool=pool, capture_error_mode="thread_local")
        if pool is None:
            self.owner.pool = g.pool()
        self.graphs.append(g)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    @property
    def takes_rope(self) -> bool:
        """Whether forward() takes the layer's rope (ForwardContext): with K/V written here,
        where Triton runs, one kernel rotates q and k into the static buffers, puts v there and
        stores K/V (in place of FlashInfer's rope, three copies and an indexed store)."""
        return self.owner.fuses_rope

    def forward(self, layer_idx: int, q, k, v, spec: LayerAttention, rope=None) -> torch.Tensor:
        o = self.owner
        t = q.shape[0]
        o.ensure_buffers(q, k)
        # q, k and v to the static buffers (a step of fresh prompts attends over its own k and
        # v, the others over the cache: the graphs serve both), K/V to the cache
        if rope is not None:  # takes_rope
            slots, cache = o.slots[:t], o.kv_views[layer_idx]
            kv_out = (o.k[:t], o.v[:t])
            triton_ops.rope_write(q, k, v, rope.table(), slots, cache, o.q[:t], kv_out)
        else:
            o.q[:t].copy_(q)
            o.k[:t].copy_(k)
            o.v[:t].copy_(v)
            if o.kv_views is not None:
                if self.at is None:
                    self.at = KVSlots.of(o.slots[:t], o.block_size)
                write_kv(o.kv_views[layer_idx], self.at, k, v)
        if self.capturing:
            self.end()
            self.layers.append((layer_idx, spec))
            self.begin()
        return o.out[:t]


class PiecewiseGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        buckets: Sequence[int],
        device: torch.device,
        pool=None,
        kv_views: list[torch.Tensor] | None = None,
        stream: torch.cuda.Stream | None = None,
    ):
        """buckets: the step sizes (tokens) to capture; pool: a graph memory pool shared with
        graphs that never replay concurrently (None: its own); kv_views: the model's KV cache
        views ([num_blocks, 2, block_size, H, D] per layer) when the segments write K/V (the
        step's attention then must not); stream: the stream to capture on, shared likewise
        (see CudaGraphRunner; None: the device's capture stream). With kv_views the segments
        take each layer's rope with its K/V write where Triton runs (triton_ops.rope_write)."""
        self.model, self.device, self.pool, self.stream = model, device, pool, stream
        self.fuses_rope = kv_views is not None and triton_ops.triton_runs_on(kv_views[0].device)
        self.buckets = sorted(set(buckets))
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.kv_views = kv_views
        self.block_size = kv_views[0].shape[2] if kv_views else 0
        self.slots = torch.zeros(n, dtype=torch.long, device=device)  # 0: the null block
        # q/k/v before each attention call and its output after, [bucket, heads, head_dim]:
        # shared by every layer and bucket (made at the first warm-up, from the model's shapes)
        self.q = self.k = self.v = self.out = None
        self._buckets: dict[int, _Bucket] = {}

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def ensure_buffers(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if self.q is None:
            n, dev = self.max_tokens, self.device
            self.q = torch.zeros(n, *q.shape[1:], dtype=q.dtype, device=dev)
            self.k = torch.zeros(n, *k.shape[1:], dtype=k.dtype, device=dev)
            self.v = torch.zeros(n, *k.shape[1:], dtype=k.dtype, device=dev)
            self.out = torch.zeros_like(self.q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the pool's high-water mark is set once), on the
        device's capture stream, warmed up on it first: the kernels are chosen and the
        per-stream workspaces (cuBLAS's) made before any capture."""
        stream = self.stream or cuda_graph_runner.capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with cuda_graph_runner.gc_paused(), torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                ids, pos = self.input_ids[:n], self.positions[:n]
                self.model(ids, pos, ForwardContext(attn=_SegmentHook(self, capturing=False)))
                stream.synchronize()
                hook = _SegmentHook(self, capturing=True)
                hook.begin()
                hidden = self.model(ids, pos, ForwardContext(attn=hook))
                hook.end()
                self._buckets[n] = _Bucket(hook.graphs, hook.layers, hidden, hook.at)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured piecewise graphs for steps of up to %s tokens", self.buckets)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    @property
    def writes_kv(self) -> bool:
        return self.kv_views is not None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention,
        slot_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of len(input_ids) tokens, attention (the step's planned backend) between the
        segments -> hidden [T, hidden] (a view of a static buffer: valid until the next run).
        slot_mapping: the step's KV slots [T], when the segments write K/V."""
        t = input_ids.shape[0]
        size = next(n for n in self.buckets if n >= t)
        b = self._buckets[size]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if self.writes_kv:
            self.slots[:t].copy_(slot_mapping)
            self.slots[t:size].zero_()  # padded rows write the null block
        q, k, v, out = self.q[:t], self.k[:t], self.v[:t], self.out[:t]
        for g, (layer_idx, spec) in zip(b.graphs, b.layers):
            g.replay()
            attention.forward(layer_idx, q, k, v, spec, out=out)  # straight into the buffer
        b.graphs[-1].replay()
        return b.hidden[:t]
