"""The reference paged attention (models.attention.torch_paged): a decode step of sequences of
different lengths reads, for the shorter ones, positions past their end; whatever their pages
held there before (NaN, say: another model's bytes) must not reach the output."""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, LayerAttention, SeqChunk
from models.attention.torch_paged import TorchPagedAttention

BS, HQ, HKV, D = 4, 4, 2, 8
CPU = torch.device("cpu")


def _step(cache, chunks, q, k, v, spec):
    md = AttentionMetadata.build(chunks, BS, CPU)
    return TorchPagedAttention([cache], md).forward(0, q, k, v, spec)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_decode_of_mixed_lengths_ignores_what_the_pages_held_past_each_end(softcap):
    torch.manual_seed(0)
    spec = LayerAttention(scale=D**-0.5, logit_softcap=softcap)
    lens, tables = [3, 7], [[1, 2], [3, 4]]

    def run(poison: float, together: bool) -> list[torch.Tensor]:
        cache = torch.full((5, 2, BS, HKV, D), poison)
        gen = torch.Generator().manual_seed(1)
        for n, t in zip(lens, tables):  # each prompt's K/V written by a prefill
            q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
            _step(cache, [SeqChunk(0, n, t)], q, k, v, spec)
        q, k, v = (torch.randn(2, h, D, generator=gen) for h in (HQ, HKV, HKV))
        if together:
            chunks = [SeqChunk(n, 1, t) for n, t in zip(lens, tables)]
            return list(_step(cache, chunks, q, k, v, spec))
        return [
            _step(cache, [SeqChunk(n, 1, t)], q[i : i + 1], k[i : i + 1], v[i : i + 1], spec)[0]
            for i, (n, t) in enumerate(zip(lens, tables))
        ]

    want = run(0.0, together=False)  # each alone reads just its own positions
    for poison in (float("nan"), float("inf"), 1e30):
        got = run(poison, together=True)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
