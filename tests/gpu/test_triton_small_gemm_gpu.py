"""The small GEMMs of few-row decode steps on the GPU (models.layers.triton_small_gemm): at
Llama-3.1-8B's and Qwen2's shapes, 1 to 16 rows, under each tiling the benchmark tries,
against cuBLAS's linear; the ops a fused layer's GEMMs carry against the unfused chain's torch
ops (cuBLAS's GEMM, rounded where the chain rounds). (The tokens of graphs that run them:
test_cuda_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from models.layers.triton_gemv import gemv_reference
from models.layers.triton_small_gemm import SmallGemmConfig, small_gemm
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
    "qkv after add + norm": (6144, HIDDEN, "norm+h"),
    "o into the stream (+ h)": (HIDDEN, HIDDEN, "into+h"),
    "gate_up making SiLU * up": (2 * INTER, HIDDEN, "norm+glu"),
    "qkv with a bias after the norm (Qwen2)": (4608, 3584, "norm+bias"),
    "ragged gate_up making SiLU * up (Gemma 3 1B's)": (2 * 6912, 1152, "norm+glu"),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_each_fused_kind_is_the_unfused_chain(name):
    n, k, kind = FUSED[name]
    g = torch.Generator("cuda").manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias="bias" in kind, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n, device="cuda", generator=g))
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    for m in (1, 3, 8, 16):
        x, h = (torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(2))
        ops: dict = {"h": h} if "+h" in kind else {}
        if kind.startswith("norm"):
            ops["norm"] = (nw, 1e-5)
            x = x * 20  # a residual stream far from unit scale
        if kind.endswith("glu"):
            ops["glu"] = True
        stream = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        for tiling in ("16:128:4:6", "64:128:4:4", "32:256:4:4"):
            into = {"into": stream.clone()} if "into" in kind else {}
            got = small_gemm(lin, x, SmallGemmConfig.parse(tiling), **ops, **into)
            into = {"into": stream.clone()} if "into" in kind else {}
            want = gemv_reference(lin, x, **ops, **into)
            # fp32 sums in another order than cuBLAS's and, after a norm, x rounded before
            # its 1 / rms applies: the output a bf16 step or two apart (2**-6 of it); into the
            # stream, a step of the output (|y| < 4: 2**-5) added to the stream's value; GLU:
            # a step of gate or up, then the activation's own rounding
            atol = 2**-5 if into else 4e-3
            rtol = 2**-5 if ops.get("glu") else 2**-6
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"{tiling} {m}")
