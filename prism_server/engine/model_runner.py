"""Turns a scheduled batch into tensors once per step and runs the model over the paged KV cache.

Attention: FlashInfer on CUDA when it imports, else the pure-torch reference (CPU, or a GPU
without FlashInfer). Decode steps replay CUDA graphs (captured here, after load) when the backend
supports them, those with LoRA work too where the LoRA kernels run (graphs with it captured at
their first such step); other steps replay piecewise graphs, or run eagerly (with LoRA work).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from kvpool import KVCache
from models.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    SeqChunk,
    layer_specs,
)
from models.attention.flashinfer_paged import (
    DEFAULT_KERNELS,
    WORKSPACE_BYTES,
    AttentionShape,
    FlashInferBackend,
    flashinfer_available,
)
from models.attention.torch_paged import TorchPagedAttention
from models.attention.upload import host_ints, upload
from models.kernels.fused_decode import load_step_ops
from models.kernels.tuning import KernelConfig
from models.layers.fp8_linear import use_scaled_mm
from models.lora import LoraBatch
from models.tensor_parallel import collective_order
from prism_server.engine.cuda_graph_runner import DEFAULT_BATCH_SIZES, CudaGraphRunner
from prism_server.engine.piecewise_graphs import (
    DEFAULT_TOKEN_BUCKETS,
    PiecewiseGraphs,
    token_buckets,
)
from prism_server.engine.sampler import sample_batch, token_logprobs
from scheduler.batch_scheduler import ScheduledChunk
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

log = logging.getLogger(__name__)

AttentionFactory = Callable[[list[torch.Tensor], AttentionMetadata], AttentionBackend]


def launch_ahead_by_default(device: torch.device) -> bool:
    """Whether a device's models launch decode steps ahead unless told (on a GPU: its host's
    work then hides behind the device's)."""
    return device.type == "cuda"


class DeviceResources:
    """What the models of one device share, because their steps run one at a time on the engine
    thread's stream: FlashInfer's float workspace, the CUDA-graph memory pool and the capture
    stream (created on first use, never on CPU); and what every model of the device runs: which
    kernels (the device's KernelConfig, whose piecewise_max_tokens bounds the piecewise graphs),
    and whether a model's next decode step is launched before its last one's tokens are read
    (launch_ahead; None: on a GPU, where the host's work then hides behind the device's).
    enforce_eager (EngineConfig.enforce_eager): no CUDA graph is captured at all and no step is
    launched ahead."""

    def __init__(
        self,
        device: torch.device,
        kernels: KernelConfig = DEFAULT_KERNELS,
        enforce_eager: bool = False,
        launch_ahead: bool | None = None,
    ):
        self.device = device
        self.kernels = kernels
        self.enforce_eager = enforce_eager
        if enforce_eager or launch_ahead is None:
            launch_ahead = launch_ahead_by_default(device) and not enforce_eager
        self.launch_ahead = launch_ahead
        # piecewise graphs for the steps decode graphs cannot run
        self.piecewise_buckets = (
            () if enforce_eager else token_buckets(kernels.piecewise_max_tokens)
        )
        self._workspace: torch.Tensor | None = None
        self._graph_pool = None
        self._capture_stream: torch.cuda.Stream | None = None

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def capture_stream(self) -> torch.cuda.Stream:
        """The stream the device's graphs are captured on (torch gives cuBLAS a workspace per
        (thread, stream), baked into every graph captured there)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return self._capture_stream

    def graph_pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool


def default_attention(
    model: torch.nn.Module,
    kv_cache: KVCache,
    device: torch.device,
    resources: DeviceResources | None = None,
):
    """FlashInfer on CUDA when available, else the torch reference."""
    if device.type != "cuda" or not flashinfer_available():
        return TorchPagedAttention
    lay = kv_cache.layout
    shape = AttentionShape(
        num_qo_heads=model.config.num_heads,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_size=lay.block_size,
        q_dtype=next(model.parameters()).dtype,
        kv_dtype=lay.dtype,
    )
    if resources is None:
        return FlashInferBackend(shape, layer_specs(model), device)
    return FlashInferBackend(
        shape,
        layer_specs(model),
        device,
        resources.workspace(),
        resources.kernels,
    )


def _step_ops(device: torch.device, resources: DeviceResources | None):
    """The GEMVs of one-row decode graphs and the small GEMMs of the others, where the kernels
    choose them and they run here (else None, and why in the log)."""
    k = resources.kernels if resources is not None else None
    if k is None or (k.gemv is None and k.small_gemm is None):
        return None
    ops, why = load_step_ops(device, gemv=k.gemv, small=k.small_gemm, fp8_small=k.fp8_small_gemm)
    if ops is None:
        log.warning("%s: decode graphs keep cuBLAS's GEMMs: %s", device, why)
    elif ops.gemv_config is not None:
        log.info(
            "%s: one-row decode graphs run their layers as Triton GEMVs (tiling %s%s)",
            device, ops.gemv_config, ", SiLU * up out of gate_up's" if ops.glu else "",
        )  # fmt: skip
    if ops is not None and not ops.fp8:
        log.info("%s: FP8 projections keep their module in decode graphs (no E4M3 here)", device)
    elif ops is not None and ops.small_config is not None and not ops.fp8_small:
        log.info("%s: FP8 projections of decode graphs past one row keep their module", device)
    if ops is not None and ops.small_config is not None:
        log.info(
            "%s: decode graphs of at most 16 sequences run their layers as Triton's small GEMMs "
            "carrying the norms, activation and adds (tiling %s)", device, ops.small_config,
        )  # fmt: skip
    return ops


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        attention: AttentionFactory | None = None,
        cuda_graph_sizes: Sequence[int] | None = None,
        resources: DeviceResources | None = None,
        piecewise_sizes: Sequence[int] | None = None,
        piecewise_kv: bool = True,
    ):
        """cuda_graph_sizes: decode batch sizes to capture; None = DEFAULT_BATCH_SIZES where the
        attention backend supports graphs (FlashInfer on CUDA), () = no graphs at all.
        piecewise_sizes: the token buckets of the piecewise graphs of other steps; None =
        DEFAULT_TOKEN_BUCKETS where decode graphs are captured, () = none. piecewise_kv: the
        piecewise graphs write K/V too, so the step's eager part is attention alone (False: the
        K/V writes run eagerly beside it, 1.3-1.8 ms more host time per step). resources: the
        device's shared workspace and graph pool (None: this runner's own)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # an FP8 model's larger steps through _scaled_mm where it runs (before any capture)
        kernels = resources.kernels if resources is not None else DEFAULT_KERNELS
        if use_scaled_mm(model, device, kernels.fp8_scaled_mm_min_rows, kernels.fp8_swap_max_rows):
            log.info(
                "%s: FP8 projections run torch._scaled_mm for steps of %d rows or more",
                device, kernels.fp8_scaled_mm_min_rows,
            )  # fmt: skip
        self.attention = attention or default_attention(model, kv_cache, device, resources)
        self.block_size = kv_cache.layout.block_size
        self.graphs: CudaGraphRunner | None = None
        graph_attention = getattr(self.attention, "graph_attention", None)
        sizes = DEFAULT_BATCH_SIZES if cuda_graph_sizes is None else tuple(cuda_graph_sizes)
        if resources is not None and resources.enforce_eager:
            sizes = ()
        if device.type == "cuda" and graph_attention is not None and sizes:
            max_len = model.config.max_position_embeddings
            max_blocks = min(kv_cache.capacity_blocks, -(-max_len // self.block_size))
            self.graphs = CudaGraphRunner(
                model,
                kv_cache.layer_views,
                graph_attention,
                sizes,
                max_blocks,
                device,
                pool=resources.graph_pool() if resources is not None else None,
                stream=resources.capture_stream() if resources is not None else None,
                step_ops=_step_ops(device, resources),
            )
            self.graphs.capture()
        self.pieces: PiecewiseGraphs | None = None
        if piecewise_sizes is not None:
            buckets = tuple(piecewise_sizes)
        else:
            buckets = DEFAULT_TOKEN_BUCKETS if resources is None else resources.piecewise_buckets
        if self.graphs is not None and buckets:
            views = kv_cache.layer_views if piecewise_kv else None
            self.pieces = PiecewiseGraphs(
                model, buckets, device, self.graphs.pool, views, self.graphs.stream
            )
            self.pieces.capture()
        # the base's LoRA adapters (engine.adapters.BaseAdapters; set when the first is loaded)
        self.lora = None
        # FlashInfer's plan stages its tables in pinned host buffers that a queued copy reads:
        # the next plan waits for the last one's copies (recorded here), so that the host may
        # plan a step while the previous one is still queued behind another
        self._planned = torch.cuda.Event() if device.type == "cuda" else None

    @torch.inference_mode()
    def execute(
        self,
        batch: list[ScheduledChunk],
        scores: list[tuple[Request, list]] | None = None,
        on_launch: Callable[[], None] | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs one step; returns float32 logits [num_sampling_requests, vocab] for the chunks
        that reach the end of their request's tokens, in batch order. scores: where to put, per
        request that asks for prompt logprobs, those of the prompt tokens this step's chunk
        predicts (not yet computed). on_launch: host work to do while the device runs the step:
        called once the graph replay is launched, or before an eager forward (whose launches
        keep the host busy). input_ids: the step's tokens, already on the device (a step
        launched before the previous one's tokens were read: every chunk one token, sampling).
        The calling thread has the device current (the device worker sets it once). Nothing
        here waits for the device to finish earlier steps."""
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []  # index in the flat stream of each sampling chunk's last token
        for c in batch:
            start = c.start
            if input_ids is None:
                ids.extend(c.request.all_token_ids[start : start + c.num_new])
            positions.extend(range(start, start + c.num_new))
            if c.samples:
                last.append(len(positions) - 1)
        host = [host_ints(positions, torch.long), host_ints(last, torch.long)]
        if input_ids is None:
            host.append(host_ints(ids, torch.long))
        if self._planned is not None:
            self._planned.synchronize()  # the last plan's staged copies have run
        chunks = [SeqChunk(c.start, c.num_new, c.request.block_table) for c in batch]
        # the step's metadata, tokens and positions: one copy from pinned memory
        md, (pos, rows, *tokens) = AttentionMetadata.build_with(
            chunks, self.block_size, self.device, host
        )
        if input_ids is None:
            input_ids = tokens[0]
        spans = _prompt_spans(batch) if scores is not None else []
        token_slots = self.lora.token_slots(batch) if self.lora is not None else None
        graphs = self.graphs if not spans and self.graphs is not None else None
        if token_slots is not None:
            # a decode step with LoRA work replays a decode graph with it where the slots run
            # the LoRA kernels; NOTE: the piecewise graphs are captured without LoRA work, so
            # any other step with some runs eagerly (the deltas added in each layer's forward)
            slots = self.lora.slots
            if graphs is not None and graphs.can_run(md) and graphs.takes_lora(slots):
                lora_step = (slots, token_slots)
                logits = graphs.run(input_ids, pos, md, self._planned, lora_step)[rows]
                if on_launch is not None:
                    on_launch()
                return logits
            lora = slots.batch(token_slots, self.device)
            if on_launch is not None:
                on_launch()
            hidden = self._forward(input_ids, pos, md, lora=lora)
            for req, flat, lo, hi in spans:
                scores.append((req, self._score(hidden[flat : flat + hi - lo], req, lo, hi)))
            return self.model.compute_logits(hidden[rows]) if last else _no_logits(hidden)
        if graphs is not None and graphs.can_run(md):
            logits = graphs.run(input_ids, pos, md, self._planned)[rows]
            if on_launch is not None:
                on_launch()
            return logits
        if not spans and self.pieces is not None and self.pieces.fits(len(positions)):
            # FlashInfer's (pieces exist only with it): its writes skipped where the graphs write
            attn = self.attention(self.kv_cache.layer_views, md, write_kv=not self.pieces.writes_kv)
            self._planned.record()
            hidden = self.pieces.run(input_ids, pos, attn, md.slot_mapping)
            if on_launch is not None:
                on_launch()
            return self.model.compute_logits(hidden[rows]) if last else _no_logits(hidden)
        if on_launch is not None:
            on_launch()
        hidden = self._forward(input_ids, pos, md)  # writes this step's K/V
        for req, flat, lo, hi in spans:
            scores.append((req, self._score(hidden[flat : flat + hi - lo], req, lo, hi)))
        if not last:
            return _no_logits(hidden)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One eager step of each kind of attention (fresh prompts, a chunk over a cached
        prefix, decodes) and one random draw, so that every kernel a request can need is
        compiled (FlashInfer compiles at first use: minutes on a fresh machine for some) and
        chosen before the first request. The steps read and write the null block only."""
        table = [0] * 4  # block 0, whatever the block size
        # FlashInfer's prefill steps through each backend they may take (fa2 for small steps,
        # fa3 for large ones), though these are small
        backends = getattr(self.attention, "prefill_backends", (None,))
        steps = [
            (c, b) for c in ([SeqChunk(0, 3, table)], [SeqChunk(2, 2, table)]) for b in backends
        ]
        steps.append(([SeqChunk(3, 1, table)] * 2, None))  # decodes, eagerly (past the graphs')
        for chunks, backend in steps:  # fresh prompts, chunks over a cached prefix, decodes
            pos = [p for c in chunks for p in range(c.num_computed, c.num_computed + c.num_new)]
            ids, pos_dev = upload(
                [host_ints([0] * len(pos), torch.long), host_ints(pos, torch.long)], self.device
            )
            md = AttentionMetadata.build(chunks, self.block_size, self.device)
            views = self.kv_cache.layer_views
            attn = self.attention(views, md, prefill_backend=backend) if backend else None
            logits = self.model.compute_logits(self._forward(ids, pos_dev, md, attn)[-1:])
        sample_batch(logits, [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        pos: torch.Tensor,
        md: AttentionMetadata,
        attn: AttentionBackend | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """A step run eagerly -> hidden states [T, hidden]. attn: the step's attention, planned
        for md (None: the runner's attention factory's); lora: the step's adapters' work."""
        if attn is None:
            attn = self.attention(self.kv_cache.layer_views, md)
        ctx = ForwardContext(attn=attn, lora=lora)
        if self._planned is not None:
            self._planned.record()
        return self.model(input_ids, pos, ctx)

    def _score(self, hidden: torch.Tensor, req: Request, lo: int, hi: int) -> list:
        """The logprobs of prompt tokens lo+1 .. hi, from the hidden states of positions lo ..
        hi-1 (in slices: a slice's logits are [n, vocab] float32)."""
        out = []
        k = req.params.prompt_logprobs
        for s in range(0, hi - lo, _SCORE_SLICE):
            logits = self.model.compute_logits(hidden[s : s + _SCORE_SLICE])
            targets = req.prompt_token_ids[lo + s + 1 : lo + s + 1 + len(logits)]
            out += token_logprobs(logits, targets, k)
        return out


_SCORE_SLICE = 256  # prompt positions scored at once


def _no_logits(hidden: torch.Tensor) -> torch.Tensor:
    """The logits of a step that samples nothing (its chunks stop short of their prompts)."""
    return hidden.new_empty(0, 0, dtype=torch.float32)


def _prompt_spans(batch: list[ScheduledChunk]) -> list[tuple[Request, int, int, int]]:
    """(request, offset in the step's flat tokens, first position, end) of the prompt
    positions each chunk computes whose next token's logprob its request wants and has not got
    (a preempted request recomputes positions it scored already)."""
    spans, flat = [], 0
    for c in batch:
        req = c.request
        if req.params.prompt_logprobs is not None:
            lo = max(c.start, len(req.prompt_logprobs))
            hi = min(c.start + c.num_new, req.num_prompt_tokens - 1)
            if lo < hi:
                spans.append((req, flat + lo - c.start, lo, hi))
        flat += c.num_new
    return spans


class TensorParallelRunner(ModelRunner):
    """The runner of a model split over several devices (TensorParallel over a ShardedKV): every
    step eager, each shard given the step's metadata and attention on its device, over its own
    KV cache; the shards stepped in lockstep from this thread. Logits come from the first
    shard. No CUDA graphs yet. Its next step may be planned while the last one is queued
    (launch ahead): each shard's plan first waits for its last plan's staged copies."""

    def __init__(self, tp, kv):
        self.model = tp
        self.kv_cache = kv.cache
        self.caches = kv.caches
        self.device = tp.devices[0]
        self.attentions = [
            default_attention(s, c, d) for s, c, d in zip(tp.shards, kv.caches, tp.devices)
        ]
        self.attention = self.attentions[0]
        self.block_size = kv.layout.block_size
        self.graphs = None
        self.pieces = None
        self.lora = None  # (adapters do not run on a split model)
        self._planned = None  # one event per shard instead
        self._plans = [torch.cuda.Event() if d.type == "cuda" else None for d in tp.devices]

    def _forward(self, input_ids, pos, md) -> torch.Tensor:
        ids, poss, ctxs = [], [], []
        shards = zip(self.attentions, self.caches, self.model.devices, self._plans)
        with collective_order:  # the whole step queued before another split model's
            for attn, cache, dev, planned in shards:
                # the shard's device current while its attention is planned (FlashInfer stages
                # its tables on the current device's stream)
                with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                    if planned is not None:
                        planned.synchronize()  # the shard's last plan's staged copies have run
                    ctxs.append(ForwardContext(attn=attn(cache.layer_views, md.to(dev))))
                    if planned is not None:
                        planned.record()
                    ids.append(input_ids.to(dev, non_blocking=True))
                    poss.append(pos.to(dev, non_blocking=True))
            return self.model(ids, poss, ctxs)[0]
