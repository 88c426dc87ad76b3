"""The small GEMMs of few-row decode steps on the GPU (models.layers.triton_small_gemm): at
Llama-3.1-8B's and Qwen2's shapes, 1 to 16 rows, under each tiling the benchmark tries,
against cuBLAS's linear. (The tokens of graphs that run them: test_cuda_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from models.layers.triton_small_gemm import SmallGemmConfig, small_gemm
from tests.gpu.common import GPU

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
