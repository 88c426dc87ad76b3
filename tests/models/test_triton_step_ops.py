"""Triton's kernels for a small decode step's norms and activation, under Triton's interpreter:
FlashInfer's numerics (fp32 add, sum and scale, one cast), every row and column, riders for the
L2 asks, and a forward that takes them. (On a GPU, with PDL and the prefetch:
tests/gpu/test_l2_prefetch_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.layers import triton_step_ops as ops
from models.loader import load_model

pytest.importorskip("triton")


def flashinfer_add_rmsnorm(x, r, w, eps):
    s = x.float() + r.float()
    inv = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (s * inv * w.float()).to(x.dtype), s.to(r.dtype)


@pytest.mark.parametrize("rows,dim", [(1, 4096), (3, 896), (16, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm_is_flashinfers_in_place(rows, dim, dtype):
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    r = torch.randn(rows, dim, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    want, want_r = flashinfer_add_rmsnorm(x, r, w, 1e-5)
    ops.add_rmsnorm(x, r, w, 1e-5)
    # the add: one rounding both ways (the interpreter rounds to bf16 toward zero, the GPU to
    # nearest: one bf16 step apart at most, 2**-7 of the value); the norm: fp32 sums in
    # another order too
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(r, want_r, rtol=2**-7 if bf16 else 0, atol=0)
    torch.testing.assert_close(x, want, rtol=2e-2 if bf16 else 1e-5, atol=1e-5)


def test_add_rmsnorm_takes_strided_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2 * 512, generator=g)[:, :512]  # rows 1024 apart
    r = torch.randn(4, 512, generator=g)
    w = torch.randn(512, generator=g)
    want, want_r = flashinfer_add_rmsnorm(x, r, w, 1e-6)
    ops.add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(x, want)
    torch.testing.assert_close(r, want_r)


@pytest.mark.parametrize("rows,dim", [(1, 14336), (5, 4864), (2, 100)])
def test_silu_mul_is_flashinfers(rows, dim):
    g = torch.Generator().manual_seed(dim)
    gu = torch.randn(rows, 2 * dim, generator=g).bfloat16()
    want = gu[:, :dim].float() / (1 + torch.exp(-gu[:, :dim].float())) * gu[:, dim:].float()
    got = ops.silu_mul(gu)
    assert got.shape == (rows, dim) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), rtol=2**-7, atol=0)  # rounding, as above


def test_riders_spread_the_l2_asks():
    mib = 1 << 20
    assert ops._grid(1, None) == (1, 0, 0, 0, 0)
    # 12 MiB of 16 KiB asks: 768, at most 32 a program -> 24 programs, 1 of them the norm's
    n, *_ = ops._grid(1, ((1 << 40, 12 * mib), (0, 0)))
    assert n == 24
    assert ops._grid(224, ((1 << 40, 12 * mib), (1 << 41, 4 * mib)))[0] == 224  # enough already


def test_load_step_ops_checks_them_against_the_reference():
    step_ops, why = ops.load_step_ops(torch.device("cpu"), pdl=True, prefetch=True)
    assert why is None
    assert not step_ops.pdl and not step_ops.takes_prefetch  # Hopper's only


BLOCK = 4  # tokens a page of tiny_bf16_llama's caches


def tiny_bf16_llama():
    """The tiny Llama in bf16 on the CPU and a paged cache for it: 3 pages of BLOCK tokens a
    layer."""
    lm = load_model("dummy:tiny-llama", dtype=torch.bfloat16)
    cfg = lm.config
    caches = [
        torch.zeros(3, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        for _ in range(cfg.num_layers)
    ]
    return lm, caches


def cached_decode_step(rows: int):
    """The tiny bf16 Llama with a 5-token prompt in its cache, and a decode step of `rows` new
    tokens after it: (lm, caches, the caches as the prompt left them, the step's metadata, ids,
    positions, the model's own output for the step). The step wrote its K/V into caches:
    copy `saved` back before running it again."""
    lm, caches = tiny_bf16_llama()
    cpu = torch.device("cpu")
    md = AttentionMetadata.build([SeqChunk(0, 5, [1, 2])], BLOCK, cpu)
    prompt = torch.tensor([5, 17, 200, 3, 99])
    lm.model(prompt, torch.arange(5), ForwardContext(attn=TorchPagedAttention(caches, md)))
    step = AttentionMetadata.build([SeqChunk(5, rows, [1, 2])], BLOCK, cpu)
    ids, pos = torch.tensor([42, 7, 8][:rows]), torch.arange(5, 5 + rows)
    saved = [c.clone() for c in caches]
    plain = lm.model(ids, pos, ForwardContext(attn=TorchPagedAttention(caches, step)))
    return lm, caches, saved, step, ids, pos, plain


@torch.no_grad()
def test_a_bf16_forward_through_the_step_ops():
    """The tiny Llama in bf16 on the CPU: its norms (all but the first layer's input norm, the
    final one too) and its activations through the Triton kernels, against the model's own."""
    lm, caches = tiny_bf16_llama()
    cfg, bs = lm.config, BLOCK
    ids = torch.tensor([5, 17, 200, 3, 99])
    md = AttentionMetadata.build([SeqChunk(0, 5, [1, 2])], bs, torch.device("cpu"))
    plain = lm.model(ids, torch.arange(5), ForwardContext(attn=TorchPagedAttention(caches, md)))
    calls = {"add_rmsnorm": 0, "silu_mul": 0}

    class Counting(ops.StepOps):
        def add_rmsnorm(self, *a):
            calls["add_rmsnorm"] += 1
            return super().add_rmsnorm(*a)

        def silu_mul(self, *a):
            calls["silu_mul"] += 1
            return super().silu_mul(*a)

    ctx = ForwardContext(attn=TorchPagedAttention(caches, md), step_ops=Counting())
    got = lm.model(ids, torch.arange(5), ctx)
    n = cfg.num_layers
    assert calls == {"add_rmsnorm": 2 * n, "silu_mul": n}  # and the final norm
    rel = (got.float() - plain.float()).norm() / plain.float().norm()
    assert rel < 2e-2, float(rel)  # two bf16 numerics (the torch path rounds the sum first)
