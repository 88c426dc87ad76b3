"""The host side of CUDA-graph capture, run on the CPU: CUDA's graph and stream calls become
no-ops, so the model runs eagerly where it would be captured. What is checked is what the capture
code builds and hands on (segments, the attention calls between them, static buffers, where
K/V go, a decode graph's tables), not what a replay computes: the GPU tests do that. It catches
what CI could not otherwise see in code that only runs on a GPU (a renamed attribute, a wrong
argument)."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch

import prism_server.engine.cuda_graph_runner as cgr
import prism_server.engine.piecewise_graphs as pg
from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.kv_write import KVSlots, RowsWriter
from models.attention.table_decode import TableDecodeGraphAttention
from models.attention.torch_paged import TorchPagedAttention
from models.kernels.fused_decode import StepOps
from models.kernels.triton_gemv import GemvConfig
from models.lora import LoraSlots
from prism_server.engine.cuda_graph_runner import CudaGraphRunner
from tests.gpu.common import cpu_kv, tiny_model
from tests.models.lora_cases import random_weights

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

CPU = torch.device("cpu")


class _NoGraph:
    def capture_begin(self, pool=None, capture_error_mode=None):
        pass

    def capture_end(self):
        pass

    def replay(self):
        pass

    def pool(self):
        return "pool"


class _NoStream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def no_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _NoGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cgr, "capture_stream", lambda device: _NoStream())


def table_runner(model, kv, kernel, sizes, **kw) -> CudaGraphRunner:
    """Decode graphs of `sizes` (at most 8 blocks a sequence) over a table decode `kernel`."""
    writer = functools.partial(RowsWriter, block_size=16)
    return CudaGraphRunner(
        model,
        kv.layer_views,
        lambda views, bs, max_blocks: TableDecodeGraphAttention(
            kernel, views, bs, max_blocks, writer
        ),
        sizes,
        8,
        CPU,
        **kw,
    )


@pytest.mark.parametrize("fused_rope", [True, False], ids=["rope-write", "rope-then-store"])
def test_piecewise_capture_builds_a_segment_per_attention_call(
    no_cuda_graphs, fused_rope, monkeypatch
):
    """Where Triton runs (here under its interpreter) the segments rotate q and k into the
    static buffers, put v there and store K/V in one Triton kernel, no slot index made; where
    it does not, FlashInfer's or torch's rope, then copies and an indexed store at the index."""
    if not fused_rope:
        monkeypatch.setattr(pg.triton_ops, "triton_runs_on", lambda device: False)
    cfg, model = tiny_model()
    kv = cpu_kv(cfg)
    pieces = pg.PiecewiseGraphs(model, (8, 16), CPU, kv_views=kv.layer_views)
    assert pieces.fuses_rope is fused_rope
    ropes = []
    rope_write = pg.triton_ops.rope_write

    def recording(q, k, v, table, slots, cache, q_out=None, kv_out=None):
        mine = (pieces.q, pieces.k, pieces.v)
        ropes.append([x.data_ptr() for x in (q_out, *kv_out)] == [x.data_ptr() for x in mine])
        return rope_write(q, k, v, table, slots, cache, q_out, kv_out)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(pg.triton_ops, "rope_write", recording)
        pieces.capture()
    # each bucket's warm-up and capture, every layer, straight into the static q, k and v
    assert ropes == ([True] * 2 * 2 * cfg.num_layers if fused_rope else [])
    for n, b in pieces._buckets.items():
        assert len(b.graphs) == cfg.num_layers + 1  # one segment before each attention call
        assert [layer for layer, _ in b.layers] == list(range(cfg.num_layers))
        if fused_rope:
            assert b.at is None
        else:
            assert isinstance(b.at, KVSlots) and b.at.blocks.shape == (n,)
        assert b.hidden.shape == (n, cfg.hidden_size)
    assert pieces.q.shape == (16, cfg.num_heads, cfg.head_dim)
    assert pieces.k.shape == pieces.v.shape == (16, cfg.num_kv_heads, cfg.head_dim)
    # a step of 11 tokens replays the 16-token bucket: its slots refilled, the rest null
    blocks = kv.allocator.allocate(1)
    md = AttentionMetadata.build([SeqChunk(0, 11, blocks)], 16, CPU)
    with torch.inference_mode():
        hidden = pieces.run(
            torch.arange(11),
            torch.arange(11),
            TorchPagedAttention(kv.layer_views, md),
            md.slot_mapping,
        )
    assert hidden.shape == (11, cfg.hidden_size)
    assert pieces.slots[:11].tolist() == md.slot_mapping.tolist() and not pieces.slots[11:].any()
    kv.allocator.free(blocks)
    kv.check_integrity()
    kv.close()


def test_decode_graphs_hand_the_table_kernel_a_contiguous_query_and_their_tables(no_cuda_graphs):
    """The table-reading decode kernel is a stand-in here that takes no rope (the Triton
    kernel's own tests run it): it records what each captured layer gives it."""
    cfg, model = tiny_model(num_attention_heads=8)
    kv = cpu_kv(cfg)
    calls = []

    def kernel(q, cache, tables, seq_lens, spec):
        calls.append((q.shape, q.is_contiguous(), tables.shape, seq_lens.shape))
        return torch.zeros_like(q)

    runner = table_runner(model, kv, kernel, (1, 4))
    with torch.inference_mode():
        runner.capture()
        # each size: a warm-up and a capture, every layer once each
        q = (cfg.num_heads, cfg.head_dim)
        assert (
            calls
            == [((4, *q), True, (4, 8), (4, 1))] * 2 * cfg.num_layers
            + [((1, *q), True, (1, 8), (1, 1))] * 2 * cfg.num_layers
        )
        md = AttentionMetadata.build([SeqChunk(20, 1, [1, 2]), SeqChunk(3, 1, [3])], 16, CPU)
        assert runner.can_run(md)
        runner.run(torch.tensor([5, 6]), torch.tensor([20, 3]), md)
    attn = runner.graphs[4].attn
    assert attn.tables[:2, :2].tolist() == [[1, 2], [3, 0]] and attn.lens.tolist() == [21, 4, 1, 1]
    kv.check_integrity()
    kv.close()


def test_the_garbage_collector_is_held_off_during_captures_and_restored():
    assert gc.isenabled()
    with cgr.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cgr.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()


def test_small_decode_graphs_run_the_fused_decode_forward(no_cuda_graphs, monkeypatch):
    """With the step ops, the graphs of at most STEP_OPS_MAX_BATCH sequences run the model
    through models.kernels.fused_decode (chosen when they are captured), the larger ones the
    model's own forward."""
    cfg, model = tiny_model(num_attention_heads=8)
    kv = cpu_kv(cfg)
    fused = []
    forward = cgr.fused_decode.forward

    def recording(model, ids, positions, ctx, ops):
        fused.append(len(ids))
        assert ctx.step_ops is ops
        return forward(model, ids, positions, ctx, ops)

    monkeypatch.setattr(cgr.fused_decode, "forward", recording)

    def kernel(q, cache, tables, seq_lens, spec):
        return torch.zeros_like(q)

    runner = table_runner(model, kv, kernel, (1, 16, 32), step_ops=StepOps(gemv=GemvConfig()))
    with torch.inference_mode():
        runner.capture()
    assert sorted(fused) == [1, 1, 16, 16]  # a warm-up and a capture each; 32 its own forward
    kv.check_integrity()
    kv.close()


def _torch_decode(q, cache, tables, seq_lens, spec):
    """The table-reading decode kernel's result through torch ops (no window, no cap)."""
    out = torch.empty_like(q)  # [B, Hq, D]
    block, heads = cache.shape[2], cache.shape[3]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = tables[b, : -(-n // block)].long()
        k, v = (cache[blocks, i].reshape(-1, heads, q.shape[2])[:n] for i in (0, 1))
        k, v = (t.repeat_interleave(q.shape[1] // heads, dim=1) for t in (k, v))
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k.float()) * spec.scale, -1)
        out[b] = torch.einsum("hn,nhd->hd", p, v.float()).to(q.dtype)
    return out


def test_decode_graphs_with_lora_work_are_captured_at_first_use_over_a_static_input(
    no_cuda_graphs,
):
    """A base whose slots run the LoRA kernels (here under Triton's interpreter): its first
    decode step with LoRA work captures the graph of its size with the kernels' work over its
    tiles (rounded up to a power of 2), once; a step of the same size and tiles replays it, one
    of fewer tiles captures its own; a step of the base alone replays the graph without; before
    each replay the static LoRA input
    holds the step's slots (the padded rows none), and the captured forward over the static
    inputs, rerun (a replay), gives the logits of the eager forward with the torch GEMMs."""
    cfg, model = tiny_model()
    kv = cpu_kv(cfg)
    runner = table_runner(model, kv, _torch_decode, (1, 4))
    g = torch.Generator().manual_seed(5)
    ker = LoraSlots(model, num_slots=3, max_rank=8, kernels=True)
    ref = LoraSlots(model, num_slots=3, max_rank=8, kernels=False)
    ranks = [{"q_proj": 4, "v_proj": 8, "down_proj": 8}, {"k_proj": 2, "gate_proj": 6, "o_proj": 8}]
    for slot, r in zip((2, 0), ranks):
        w = random_weights(model, r, g, std=0.2)
        ker.assign(slot, w)
        ref.assign(slot, w)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    tables = [kv.allocator.allocate(1) for _ in prompts]
    with torch.inference_mode():
        runner.capture()
        for p, blocks in zip(prompts, tables):  # the prompts' K/V in the cache
            md = AttentionMetadata.build([SeqChunk(0, len(p), blocks)], 16, CPU)
            model(
                torch.tensor(p),
                torch.arange(len(p)),
                ForwardContext(TorchPagedAttention(kv.layer_views, md)),
            )
        plain = runner.graphs[4]
        steps = [[2, -1, 0], [0, 0, 2], [-1, -1, -1], [0, 0, -1]]
        keys = [[(4, 2)]] * 3 + [[(4, 2), (4, 1)]]  # (size, tiles): slots 0 and 2, then 0
        for n, token_slots in enumerate(steps):
            chunks = [SeqChunk(len(p) + n, 1, t) for p, t in zip(prompts, tables)]
            md = AttentionMetadata.build(chunks, 16, CPU)
            ids = torch.tensor([40 + n, 50 + n, 60 + n])
            pos = torch.tensor([c.num_computed for c in chunks])
            lora = (ker, token_slots) if set(token_slots) != {-1} else None
            runner.run(ids, pos, md, lora=lora)
            assert list(runner.lora_graphs) == keys[n]  # captured at their first step, kept
            g4 = runner.lora_graphs[keys[n][-1]]
            if lora is None:
                assert runner.buffers.lora.buf[:4].tolist() == steps[1] + [-1]  # left as it was
                continue
            assert g4.lora.token_slots.tolist() == token_slots + [-1]
            replayed = runner._forward(4, g4.attn, g4.lora)[:3]
            ctx = ForwardContext(
                TorchPagedAttention(kv.layer_views, md), lora=ref.batch(token_slots, CPU)
            )
            want = model.compute_logits(model(ids, pos, ctx))
            assert torch.allclose(replayed, want, atol=1e-4, rtol=0), float(
                (replayed - want).abs().max()
            )
            without = model.compute_logits(
                model(ids, pos, ForwardContext(TorchPagedAttention(kv.layer_views, md)))
            )
            assert float((without - want).abs().max()) > 1e-2  # the adapters matter
        assert runner.graphs[4] is plain and set(runner.graphs) == {1, 4}
    for blocks in tables:
        kv.allocator.free(blocks)
    kv.check_integrity()
    kv.close()
