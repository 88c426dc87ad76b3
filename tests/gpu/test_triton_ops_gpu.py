"""The Triton decode kernels on the GPU at the sizes that matter: a batch-1 step over a long
context (16 programs a KV head merging through their tickets) and a batch of 64, each launched
again after the first (the tickets must be back at zero), against the torch reference."""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, LayerAttention, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.kernels import triton_ops
from tests.gpu.common import GPU

pytestmark = GPU
BLOCK = 16


def decode_step(lens: list[int], hkv: int, d: int, gen: torch.Generator):
    """A decode step of sequences `lens` long over a random bf16 cache on the GPU, their blocks
    shuffled (block 0, the null block, unused): (md, cache)."""
    nblocks = sum(-(-n // BLOCK) for n in lens) + 1
    cache = torch.randn(nblocks, 2, BLOCK, hkv, d, device="cuda", generator=gen).bfloat16()
    perm = (torch.randperm(nblocks - 1, device="cuda", generator=gen) + 1).tolist()
    chunks = []
    for n in lens:
        nb = -(-n // BLOCK)
        chunks.append(SeqChunk(n - 1, 1, perm[:nb]))
        perm = perm[nb:]
    return AttentionMetadata.build(chunks, BLOCK, torch.device("cuda")), cache


@pytest.mark.parametrize(
    "lens,heads", [([8191], (32, 8)), ([1000] * 64, (32, 8)), ([1, 2000, 33, 4096], (8, 1))]
)
def test_decode_kernel_matches_the_reference_again_and_again(lens, heads):
    hq, hkv, d = heads[0], heads[1], 128
    gen = torch.Generator(device="cuda").manual_seed(len(lens))
    md, cache = decode_step(lens, hkv, d, gen)
    kernel = triton_ops.TritonDecodeKernel(hq, hkv, d, BLOCK, torch.device("cuda"))
    spec = LayerAttention(scale=d**-0.5)
    at = md.slot_mapping
    k, v = cache[at // BLOCK, 0, at % BLOCK], cache[at // BLOCK, 1, at % BLOCK]
    for _ in range(3):
        q = torch.randn(len(lens), hq, d, device="cuda", generator=gen).bfloat16()
        got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
        ref = TorchPagedAttention([cache.clone()], md)
        want = ref.forward(0, q.float(), k.float(), v.float(), spec)
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 1e-2, float(rel)
        assert not kernel.tickets.any()


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_attention_that_takes_the_rope_matches_the_rope_kernel_then_attention(batch):
    """The decode kernel rotating q and k and storing k, v itself (one kernel a layer) against
    the rope kernel, then the kernel over the cache: the same cache, outputs within rounding."""
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(batch)
    lens = torch.randint(1, 1500, (batch,), generator=gen, device="cuda").tolist()
    md, cache = decode_step(lens, hkv, d, gen)
    rows = torch.randn(batch, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(batch, d // 2, device="cuda", generator=gen) * 100
    table = torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()
    spec = LayerAttention(scale=d**-0.5)
    kernel = triton_ops.TritonDecodeKernel(hq, hkv, d, BLOCK, torch.device("cuda"))
    outs, caches = [], []
    for fused in (True, False):
        c, r = cache.clone(), rows.clone()
        q, k, v = r.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(batch, hq, d), k.view(batch, hkv, d), v.view(batch, hkv, d)
        lens_ = md.seq_lens.view(-1, 1)
        if fused:
            new = (k, v, table, md.slot_mapping)
            outs.append(kernel(q, c, md.block_tables, lens_, spec, new))
        else:
            q = triton_ops.rope_write(q, k, v, table, md.slot_mapping, c, q.contiguous())
            outs.append(kernel(q, c, md.block_tables, lens_, spec))
        caches.append(c)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-6, rtol=2**-7)
    rel = (outs[0].float() - outs[1].float()).norm() / outs[1].float().norm()
    assert rel < 5e-3, float(rel)
    assert not kernel.tickets.any()
