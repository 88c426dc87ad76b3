"""CUDA graphs for decode steps: captured once per model after load, replayed per step.

One graph per batch size in `batch_sizes` (embedding .. logits of the whole model); a step of b
decodes replays the smallest captured size >= b, padded rows reading and writing the null block
(block 0, on page 0, which is always mapped). Inputs live in static buffers; the attention plan is
refilled outside the graph before each replay. The KV cache's addresses never change (pages are
mapped and unmapped under a fixed virtual range), so the graphs stay valid while the model's pages
come and go.

A base with LoRA adapters whose slots run the LoRA kernels (LoraSlots.kernels) has a second set
of decode graphs, each captured the first time a step of its size and its count of LoRA tiles
(rounded up to a power of 2) has LoRA work: the same forward with the kernels' deltas over a
static LoRA input (models.lora.LoraGraphInput: the step's tokens grouped by slot, NO_ADAPTER
for the base's and the padded rows), refilled before each replay. Steps of the base's tokens
alone keep replaying the graphs without LoRA work.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.kernels import fused_decode
from models.kernels.fused_decode import STEP_OPS_MAX_BATCH, StepOps
from models.lora import LoraBatch, LoraGraphInput, LoraSlots

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class GraphAttention(Protocol):
    """An attention backend usable inside a graph of fixed batch size."""

    batch_size: int

    def fits(self, md: AttentionMetadata) -> bool: ...

    def plan(self, md: AttentionMetadata) -> None:
        """Outside the graph: refill the fixed buffers for md's batch (padded)."""

    def prepare(self) -> None:
        """Inside the graph, before the first layer: per-step device work."""

    def forward(self, layer_idx: int, q, k, v, spec) -> torch.Tensor: ...


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's shared capture stream, for graphs captured without the device's own (see
    CudaGraphRunner). A capture and its warm-up run on a stream of the model's device:
    torch's default capture stream is made once per process, on the device current then, and
    a capture on another device's stream records nothing of the model's kernels."""
    return torch.cuda.Stream(device)


# (kv views, batch size, max blocks per sequence) -> the graph attention of that size
GraphAttentionFactory = Callable[[list[torch.Tensor], int, int], GraphAttention]


@dataclass
class GraphBuffers:
    """Static inputs of every captured graph (sized for the largest) and each graph's output."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # bs -> [bs, vocab] fp32
    # the LoRA graphs' static LoRA input (made with the first of them)
    lora: LoraGraphInput | None = None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    attn: GraphAttention
    logits: torch.Tensor  # [bs, vocab] fp32: its static output
    lora: LoraBatch | None = None  # the LoRA work it was captured with


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off while graphs are captured (one collection
    first): a collection inside a capture could free objects whose release makes a CUDA call
    the capture forbids, and a full collection costs milliseconds a capture."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_views: list[torch.Tensor],
        attention: GraphAttentionFactory,
        batch_sizes: Sequence[int],
        max_blocks: int,
        device: torch.device,
        pool=None,
        stream: torch.cuda.Stream | None = None,
        step_ops: StepOps | None = None,
    ):
        """pool: a graph memory pool (torch.cuda.graph_pool_handle()) to capture into, shared
        with other runners whose graphs never replay concurrently; None = a pool of its own.
        stream: the stream of the device to capture on, shared likewise (graphs captured on one
        stream by one thread share one cuBLAS workspace); None = the device's capture_stream.
        step_ops: the GEMVs and small GEMMs that run the layers of the graphs of at most
        STEP_OPS_MAX_BATCH sequences (None: the model's own forward)."""
        self.model, self.kv_views, self.attention = model, kv_views, attention
        self.pool, self.stream = pool, stream
        self.step_ops = step_ops
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_blocks, self.device = max_blocks, device
        n = self.batch_sizes[-1]
        self.buffers = GraphBuffers(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
        )
        self.graphs: dict[int, _Graph] = {}
        # (bs, tiles) -> its graph with LoRA work over `tiles` tiles (LoraGraphInput.tiles_for)
        self.lora_graphs: dict[tuple[int, int], _Graph] = {}
        self._lora_slots: LoraSlots | None = None  # the slots the LoRA graphs read

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, into one memory pool. Only the static
        outputs (logits) outlive a replay, so graphs sharing the pool never see each other's
        live data. Each size is warmed up first on the capture stream (kernels chosen, the
        stream's cuBLAS workspace made), after the work queued before on the current one."""
        self.graphs.update(self._capture(self.batch_sizes, None))
        log.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    def _capture(
        self, sizes: Sequence[int], lora: LoraGraphInput | None, tiles: int = 0
    ) -> dict[int, _Graph]:
        """Graphs of `sizes`, with the LoRA work of `lora` over `tiles` tiles (None: none)."""
        graphs = {}
        if lora is not None:
            lora.fill([])  # the warm-ups read no adapter's weights (some may be evicted)
        pool = self.pool
        stream = self.stream or capture_stream(self.device)
        outer = torch.cuda.current_stream(self.device)
        stream.wait_stream(outer)
        with gc_paused(), torch.cuda.stream(stream):
            for bs in sorted(sizes, reverse=True):
                attn = self.attention(self.kv_views, bs, self.max_blocks)
                null_rows = [SeqChunk(0, 1, [0])] * bs  # one-token sequences in the null block
                md = AttentionMetadata.build(null_rows, self._block_size(), self.device)
                attn.plan(md)
                work = lora.batch(bs, tiles) if lora is not None else None
                self._forward(bs, attn, work)  # warm-up
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                # NOTE: thread_local: the engine thread may be stepping other models meanwhile.
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    logits = self._forward(bs, attn, work)
                if lora is None:
                    self.buffers.logits[bs] = logits
                pool = graph.pool()
                graphs[bs] = _Graph(graph, attn, logits, work)
        self.pool = pool  # the pool they were captured into (other graphs of the model share it)
        outer.wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return graphs

    def takes_lora(self, slots: LoraSlots) -> bool:
        """Whether decode steps with the LoRA work of `slots` can replay graphs here (their
        LoRA work is the kernels')."""
        return slots.kernels

    def _lora_graph(self, slots: LoraSlots, bs: int, token_slots: Sequence[int]) -> _Graph:
        """The graph of size bs with `slots`' LoRA work for these tokens' tiles, captured now
        if it is not yet."""
        if self._lora_slots is not slots:  # (a base has one LoraSlots: made once)
            self.lora_graphs.clear()
            self.buffers.lora = slots.graph_input(self.max_batch_size)
            self._lora_slots = slots
        key = (bs, self.buffers.lora.tiles_for(token_slots, bs))
        if key not in self.lora_graphs:
            self.lora_graphs[key] = self._capture([bs], self.buffers.lora, key[1])[bs]
            log.info("captured the decode graph of batch size %d with LoRA work (%d tiles)", *key)
        return self.lora_graphs[key]

    def _block_size(self) -> int:
        return self.kv_views[0].shape[2]

    def _forward(self, bs: int, attn: GraphAttention, lora: LoraBatch | None) -> torch.Tensor:
        attn.prepare()
        ops = self.step_ops if bs <= STEP_OPS_MAX_BATCH else None
        # (with LoRA work every layer an adapter may target runs its own forward, the deltas
        # added in ForwardContext.linear: fused_decode leaves such layers alone)
        ctx = ForwardContext(attn=attn, step_ops=ops, lora=lora)
        ids, positions = self.buffers.input_ids[:bs], self.buffers.positions[:bs]
        if ops is not None and fused_decode.runs(self.model):  # its layers as GEMV/GEMM chains
            hidden = fused_decode.forward(self.model, ids, positions, ctx, ops)
        else:
            hidden = self.model(ids, positions, ctx)
        return self.model.compute_logits(hidden)  # [bs, vocab] fp32

    def can_run(self, md: AttentionMetadata) -> bool:
        if not md.is_decode_only or md.num_seqs > self.max_batch_size:
            return False
        return self.graphs[self._size_for(md.num_seqs)].attn.fits(md)

    def _size_for(self, b: int) -> int:
        return next(s for s in self.batch_sizes if s >= b)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        planned: torch.cuda.Event | None = None,
        lora: tuple[LoraSlots, Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """One decode step of md.num_seqs tokens -> logits [num_seqs, vocab] (a view of the
        graph's static output: valid until the next replay). planned: recorded once the plan's
        copies are queued, before the replay. lora: the base's slots and each token's slot
        (NO_ADAPTER: the base's; `takes_lora`), for a step with LoRA work."""
        b = md.num_seqs
        size = self._size_for(b)
        if lora is None:
            g = self.graphs[size]
        else:
            slots, token_slots = lora
            g = self._lora_graph(slots, size, token_slots)
            self.buffers.lora.fill(token_slots)
        self.buffers.input_ids[:b].copy_(input_ids)
        self.buffers.positions[:b].copy_(positions)
        g.attn.plan(md)
        if planned is not None:
            planned.record()
        g.graph.replay()
        return g.logits[:b]
