"""FlashInfer attention vs the torch reference on random inputs, over kvpool's VMM layout.

Mixed steps (prefill chunks over a cached prefix, fresh prompts, decodes) go through the paged
prefill wrapper; steps of fresh prompts only through the ragged one (their rope and K/V write
one Triton kernel over the slots); decode-only steps through Prism's Triton kernel, or the
decode wrapper and the CUDA-graph decode attention (padded batch). Reference:
TorchPagedAttention in float32 over the same bf16 cache. Cases: the Llama-3.1-8B head shape,
and Gemma-like head_dim 256 with a sliding window, with and without a logit soft cap.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvpool import KVLayout, PagedKV
from models.attention.base import AttentionMetadata, ForwardContext, LayerAttention, SeqChunk
from models.attention.flashinfer_paged import (
    AttentionShape,
    FlashInferBackend,
    RaggedAttention,
)
from models.attention.kv_write import RowsWriter
from models.attention.table_decode import TableDecodeAttention
from models.attention.torch_paged import TorchPagedAttention
from models.kernels.tuning import KernelConfig
from models.layers.rotary_embedding import RotaryEmbedding
from tests.gpu.common import GPU, cuda_pool

pytestmark = GPU

BLOCK = 16
LAYERS = 3
CASES = {
    "llama-8b-heads": dict(heads=32, kv_heads=8, head_dim=128, window=None, softcap=None),
    "hd256-window-softcap": dict(heads=8, kv_heads=4, head_dim=256, window=40, softcap=20.0),
    "hd256-window": dict(heads=8, kv_heads=2, head_dim=256, window=40, softcap=None),
}
MIXED = [(0, 37), (50, 20), (100, 1), (7, 1), (33, 64), (130, 3)]  # (cached, new) per sequence
DECODE = [(n, 1) for n in (0, 16, 63, 100, 254, 31, 9)]
FRESH = [(0, 37), (0, 150), (0, 5), (0, 64), (0, 2)]  # fresh prompts only: ragged attention
STEPS = {"mixed": MIXED, "fresh": FRESH, "decode": DECODE, "graph-decode": DECODE}


def make_cache(case: dict) -> PagedKV:
    pool = cuda_pool(pages=12, page_bytes=4 << 20)
    layout = KVLayout(
        LAYERS,
        BLOCK,
        case["kv_heads"],
        case["head_dim"],
        torch.bfloat16,
        pool.page_bytes,
        pool.backend.granularity,
    )
    return PagedKV(pool, "attn-test", layout, max_pages=12, max_cached_pages=12)


def make_step(kv: PagedKV, seqs: list[tuple[int, int]], gen: torch.Generator):
    """Blocks for each sequence, shuffled across pages; every allocated block of every layer
    filled with random K/V (the cached prefix, and garbage where new tokens go)."""
    need = [-(-(c + n) // BLOCK) for c, n in seqs]
    blocks = kv.allocator.allocate(sum(need))
    order = torch.randperm(len(blocks), generator=gen).tolist()
    blocks = [blocks[i] for i in order]
    tables, start = [], 0
    for n in need:
        tables.append(blocks[start : start + n])
        start += n
    idx = torch.tensor(blocks, device="cuda")
    for view in kv.layer_views:
        view[idx] = torch.randn(view[idx].shape, generator=gen).to(view)
    chunks = [SeqChunk(c, n, t) for (c, n), t in zip(seqs, tables)]
    return AttentionMetadata.build(chunks, BLOCK, torch.device("cuda")), blocks


def qkv(md: AttentionMetadata, case: dict, gen: torch.Generator, pad_to: int = 0):
    """Random q, k, v as a layer makes them: strided views of one projection's rows."""
    t = max(md.num_tokens, pad_to)
    d, hq, hkv = case["head_dim"], case["heads"], case["kv_heads"]
    rows = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = rows.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    worst = (out - ref).abs().max() / ref.abs().max()
    assert rel < 1e-2 and worst < 5e-2, (float(rel), float(worst))


def step_rope(md: AttentionMetadata, head_dim: int, rows: int):
    """The step's rope table: each token at its position (padded rows at 0)."""
    pos = [p for s, n in zip(md.seq_lens_cpu, md.query_lens_cpu) for p in range(s - n, s)]
    pos += [0] * (rows - len(pos))
    return RotaryEmbedding(head_dim, 10000.0).cuda()(torch.tensor(pos, device="cuda"))


def rotated(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in fp32 (GPT-NeoX halves), cast back."""
    half = x.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def run_and_compare(kv, md, attn, spec, case, gen, pad_to: int = 0) -> None:
    """Each layer through ForwardContext with the step's rope (the backend may take it with its
    K/V write), against the rope, then the reference backend."""
    t = md.num_tokens
    for layer in range(LAYERS):
        q, k, v = qkv(md, case, gen, pad_to)
        rope = step_rope(md, case["head_dim"], q.shape[0])
        rq, rk = rotated(q, rope.table())[:t], rotated(k, rope.table())[:t]
        out = ForwardContext(attn=attn).attention(layer, q, k, v, spec, rope)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        v, out = v[:t], out[:t]  # padded rows: garbage in the null block
        # this step's K/V landed where the slot mapping says (rotated k: within one rounding)
        view = kv.layer_views[layer]
        blocks, offsets = md.slot_mapping // BLOCK, md.slot_mapping % BLOCK
        torch.testing.assert_close(view[blocks, 0, offsets], rk, atol=1e-6, rtol=2**-7)
        assert torch.equal(view[blocks, 1, offsets], v)
        ref = TorchPagedAttention(kv.layer_views, md).forward(
            layer, rq.float(), view[blocks, 0, offsets].float(), v.float(), spec
        )
        check_close(out, ref)


KERNELS = {
    "default": KernelConfig(),  # Triton's decode
    "flashinfer-decode": KernelConfig(decode_backend_max_batch=0),
    # every step's (the default: from 1024 query tokens, past these small steps)
    "fa3-prefill": KernelConfig(prefill_backend="fa3", prefill_backend_min_tokens=0),
    # FlashInfer's choice: fa3 on Hopper where it has the head_dim (these cases), else fa2
    "fa3-auto-prefill": KernelConfig(prefill_backend="auto", prefill_backend_min_tokens=0),
    "triton-splits-4-stages-1": KernelConfig(triton_max_splits=4, triton_stages=1),
    # batches of 7 (eager) and 8 (a graph) are past its 4: FlashInfer's decode runs them
    "triton-decode-upto-4": KernelConfig(decode_backend_max_batch=4),
}
TOUCHES = {  # the kinds of step each choice changes
    "flashinfer-decode": {"decode", "graph-decode"},
    "fa3-prefill": {"mixed", "fresh"},
    "fa3-auto-prefill": {"mixed", "fresh"},
    "triton-splits-4-stages-1": {"decode", "graph-decode"},
    "triton-decode-upto-4": {"decode", "graph-decode"},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("kernels", list(KERNELS))
def test_flashinfer_matches_reference(name, kind, kernels):
    if kernels != "default" and kind not in TOUCHES[kernels]:
        pytest.skip("the choice does not touch this kind of step")
    case = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{kind}".encode()))
    kv = make_cache(case)
    spec = LayerAttention(
        scale=case["head_dim"] ** -0.5,
        sliding_window=case["window"],
        logit_softcap=case["softcap"],
    )
    shape = AttentionShape(
        case["heads"], case["kv_heads"], case["head_dim"], BLOCK, torch.bfloat16, torch.bfloat16
    )
    backend = FlashInferBackend(shape, [spec], torch.device("cuda"), kernels=KERNELS[kernels])
    # the kernel that reads the block table itself: Triton's, unless FlashInfer's decodes all
    table = KERNELS[kernels].decode_backend_max_batch > 0
    assert (backend.table_kernel is not None) is table
    table = table and kernels != "triton-decode-upto-4"  # whether this step runs it
    md, blocks = make_step(kv, STEPS[kind], gen)
    pad = 0
    if kind == "graph-decode":  # the CUDA-graph attention, batch 7 padded to 8, run eagerly
        pad = 8
        attn = backend.graph_attention(kv.layer_views, pad, 32)
        attn.plan(md)
        attn.prepare()
        assert isinstance(attn, TableDecodeAttention) is table
    else:
        attn = backend(kv.layer_views, md)
        ragged = kind == "fresh"
        assert isinstance(attn, RaggedAttention) is ragged
        if ragged:  # the rope and K/V write one Triton kernel over the slots
            assert isinstance(attn.write, RowsWriter) and attn.takes_rope
        assert isinstance(attn, TableDecodeAttention) is (table and kind == "decode")
    run_and_compare(kv, md, attn, spec, case, gen, pad)
    kv.allocator.free(blocks)
    kv.check_integrity()
    kv.close()


def test_the_prefill_backends_a_model_keeps():
    """fa2's wrappers for steps under prefill_backend_min_tokens beside the chosen backend's
    (auto: fa3 on Hopper, else fa2 and one set); none of fa2's where every step takes fa3."""
    shape = AttentionShape(32, 8, 128, BLOCK, torch.bfloat16, torch.bfloat16)
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    cases = [
        (KernelConfig(), ("auto", "fa2") if hopper else ("fa2",)),
        (KernelConfig(prefill_backend="fa2"), ("fa2",)),
        (KernelConfig(prefill_backend="fa3", prefill_backend_min_tokens=0), ("fa3",)),
    ]
    for choice, want in cases:
        backend = FlashInferBackend(shape, [LayerAttention(scale=128**-0.5)], dev, kernels=choice)
        assert backend.prefill_backends == tuple(sorted(want)), choice
        assert set(backend.ragged) == set(backend.prefill)
