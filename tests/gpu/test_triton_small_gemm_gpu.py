"""The small GEMMs of few-row decode steps on the GPU (models.kernels.triton_small_gemm): at
Llama-3.1-8B's and Qwen2's shapes, 1 to 16 rows, under each tiling the benchmark tries,
against cuBLAS's linear; the ops a fused layer's GEMMs carry against the unfused chain's torch
ops (cuBLAS's GEMM, rounded where the chain rounds). (The tokens of graphs that run them:
test_cuda_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from models.kernels.triton_gemv import gemv_reference
from models.kernels.triton_small_gemm import (
    SmallGemmConfig,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from tests.gpu.common import GPU
from tests.gpu.test_triton_gemv_gpu import HIDDEN, INTER

pytestmark = GPU

SHAPES = {  # name -> (out, in, bias)
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, False),
    "qkv with a bias (Qwen2)": (4608, 3584, True),
    "ragged (Gemma 3 1B's qkv)": (1536, 1152, False),
}
TILINGS = ["16:256:4:4", "32:256:4:4", "64:128:4:4", "16:128:4:6", "32:128:4:6"]


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_small_gemm_is_cublas_linear(name):
    n, k, bias = SHAPES[name]
    g = torch.Generator("cuda").manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, device="cuda", generator=g))
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        want = lin(x)
        for tiling in TILINGS:
            got = small_gemm(lin, x, SmallGemmConfig.parse(tiling))
            # fp32 sums in another order than cuBLAS's: one bf16 step apart at most
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-3, msg=f"{tiling} {m}")


FUSED = {  # name -> (out, in, the ops)
    "qkv after the norm": (6144, HIDDEN, "pre"),
    "o into the stream, the next norm's input out": (HIDDEN, HIDDEN, "into+norm"),
    "gate_up making SiLU * up after the norm": (2 * INTER, HIDDEN, "pre+glu"),
    "down into the stream": (HIDDEN, INTER, "into"),
    "qkv with a bias after the norm (Qwen2)": (4608, 3584, "pre+bias"),
    "ragged gate_up making SiLU * up (Gemma 3 1B's)": (2 * 6912, 1152, "pre+glu"),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_each_fused_kind_is_the_unfused_chain(name):
    """Against the kernel's own roundings (small_gemm_reference: a bf16 step apart at most,
    the sums' order), and after a norm against the unfused chain's too (triton_gemv.
    gemv_reference: the normalized row rounded before the products, where the kernel rounds x
    times the norm's weight)."""
    n, k, kind = FUSED[name]
    g = torch.Generator("cuda").manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias="bias" in kind, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n, device="cuda", generator=g))
    norm = ((1 + 0.1 * torch.randn(max(n, k), device="cuda", generator=g)).bfloat16(), 1e-5)
    glu = kind.endswith("glu")
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        stream = torch.randn(m, n, device="cuda", generator=g).bfloat16() * 20
        for tiling in ("16:128:4:6", "64:128:4:4", "32:256:4:4"):
            c = SmallGemmConfig.parse(tiling)

            def msg(text, tiling=tiling, m=m):
                return f"{tiling}, {m} rows: {text}"

            if kind.startswith("pre"):
                x20, nw = x * 20, (norm[0][:k], norm[1])  # a residual stream far from unit scale
                got = small_gemm(lin, prenorm(x20, *nw), c, glu=glu)
                own = small_gemm_reference(lin, x20, pre=nw, glu=glu)
                # a bf16 step of the output (2**-7 of it); GLU: a step of gate or up, then the
                # activation's own rounding
                rtol = 2**-6 if glu else 2**-7
                torch.testing.assert_close(got, own, rtol=rtol, atol=2e-3, msg=msg)
                # x rounded at another scale than the chain's normalized row: its products'
                # rounding errors, summed over K (|y| about 1), apart
                chain = gemv_reference(lin, x20, norm=nw, glu=glu)
                torch.testing.assert_close(got, chain, rtol=2**-5, atol=3e-2, msg=msg)
                continue
            into = stream.clone()
            ops = {"norm": (norm[0][:n], norm[1])} if kind == "into+norm" else {}
            got = small_gemm(lin, x, c, into=into, **ops)
            want = small_gemm_reference(lin, x, into=stream.clone(), **ops)
            if ops:  # the stream in place, and the next norm's input out
                want, rows = want
                # (the stream's values a step apart, as below, then scaled)
                torch.testing.assert_close(got.rows, rows, rtol=2**-7, atol=2**-5, msg=msg)
                squares = got.squares.sum(0)[:m]
                torch.testing.assert_close(squares, want.float().pow(2).sum(-1), msg=msg)
            # a step of the output (|y| < 4: 2**-5) added to the stream's value
            torch.testing.assert_close(into, want, rtol=2**-7, atol=2**-5, msg=msg)
