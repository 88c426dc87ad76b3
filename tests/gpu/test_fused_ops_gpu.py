"""FlashInfer's fused kernels against the unfused arithmetic they replace, on CUDA: the rotary
embedding applied in place to q and k, and the residual add joined to the next RMSNorm. The
reference is the same module's torch path on the host. Each differs from it by bf16 rounding
only (one rounding in fp32 where the reference rounds after every op)."""

from __future__ import annotations

import pytest
import torch

from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding
from tests.gpu.common import GPU

pytestmark = GPU

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("contiguous", [False, True], ids=["in-place", "contiguous-q"])
@pytest.mark.parametrize("scaling", [None, LLAMA31], ids=["plain", "llama3"])
def test_rope_in_place_matches_the_reference(scaling, contiguous):
    """In place on the qkv projection's strided views, or (for a backend that reads q
    contiguous) q into a new contiguous tensor, its slice of the projection left as it was."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rot = RotaryEmbedding(128, 500000.0, scaling).to(dev)
    positions = torch.tensor([0, 1, 2, 7, 1000, 8191, 100000, 3], device=dev)
    qkv = torch.randn(len(positions), (32 + 2 * 8) * 128, device=dev, dtype=torch.bfloat16)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)  # strided views, as in a layer
    q, k = q.view(-1, 32, 128), k.view(-1, 8, 128)
    q_before = q.clone()
    host = RotaryEmbedding(128, 500000.0, scaling)(positions.cpu())  # the torch path
    want_q, want_k = (t.to(dev) for t in host.apply(q.cpu(), k.cpu()))
    got_q, got_k = rot(positions).apply(q, k, contiguous=contiguous)
    if contiguous:  # q new and contiguous, k turned where it lies
        assert got_q.is_contiguous() and got_q.shape == q.shape
        assert torch.equal(q, q_before) and got_k.data_ptr() == k.data_ptr()
    else:
        assert got_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    for got, want in ((got_q, want_q), (got_k, want_k)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 0.02 * want.float().abs().max().item(), err
    # not a no-op: the rotation at position 1000 moved q far from where it started
    assert (want_q[4].float() - q_before[4].float()).abs().max() > 0.5


def test_the_residual_add_joins_the_norm():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    norm = RMSNorm(4096, 1e-5).to(dev, torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(33, 4096, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(33, 4096, device=dev, dtype=torch.bfloat16) * 4
    host = RMSNorm(4096, 1e-5).to(torch.bfloat16)  # the torch path
    host.weight.data.copy_(norm.weight.data.cpu())
    want_h, want_r = (t.to(dev) for t in host.add(x.cpu(), residual.cpu()))
    got_h, got_r = norm.add(x, residual)
    assert got_r.data_ptr() == residual.data_ptr() and got_h.data_ptr() == x.data_ptr()
    assert (got_r.float() - want_r.float()).abs().max() <= 0.04  # one bf16 rounding of the sum
    rel = (got_h.float() - want_h.float()).abs().max() / want_h.float().abs().max()
    assert rel < 0.01, rel
