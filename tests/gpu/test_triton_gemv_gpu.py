"""The one-row layer's GEMVs on the GPU (models.kernels.triton_gemv): each kind at
Llama-3.1-8B's shapes against the unfused chain's torch ops (cuBLAS's GEMM, rounded where the
chain rounds), under three tilings. (The tokens of graphs that run them:
test_cuda_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from tests.gpu.common import GPU

pytestmark = GPU

HIDDEN, INTER = 4096, 14336
KINDS = {  # name -> (out, in, the ops)
    "qkv after add + norm": (6144, HIDDEN, "norm+h"),
    "o into the stream (+ h)": (HIDDEN, HIDDEN, "into+h"),
    "gate_up after the norm": (2 * INTER, HIDDEN, "norm"),
    "down after SiLU * up": (HIDDEN, INTER, "silu"),
    "gate_up making SiLU * up": (2 * INTER, HIDDEN, "norm+glu"),
    "qkv with a bias (Qwen2)": (4608, 3584, "norm+h+bias"),
}


def case(n: int, k: int, kind: str, g: torch.Generator):
    lin = torch.nn.Linear(k, n, bias="bias" in kind, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n, device="cuda", generator=g))
    x = torch.randn(1, 2 * k if kind == "silu" else k, device="cuda", generator=g).bfloat16()
    ops: dict = {}
    if "+h" in kind:
        ops["h"] = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    if kind.startswith("norm"):
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
        ops["norm"] = (nw, 1e-5)
    if kind == "silu":
        ops["silu"] = True
    if kind.endswith("glu"):
        ops["glu"] = True
    stream = torch.randn(1, n, device="cuda", generator=g).bfloat16() if "into" in kind else None
    return lin, x, ops, stream


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_is_the_unfused_chain(name):
    n, k, kind = KINDS[name]
    lin, x, ops, stream = case(n, k, kind, torch.Generator("cuda").manual_seed(n))
    for config in (GemvConfig(), GemvConfig(16, 256, 4, 1), GemvConfig(4, 2048, 8, 1)):
        into = {} if stream is None else {"into": stream.clone()}
        got = gemv(lin, x, config=config, **ops, **into)
        into = {} if stream is None else {"into": stream.clone()}
        want = gemv_reference(lin, x, **ops, **into)
        # fp32 sums in another order than cuBLAS's: the output one bf16 step apart at most
        # (2**-7 of it); into the stream, that step of the output (|y| < 4: 2**-5) is then
        # added to the stream's value, which may cancel it
        atol = 2**-5 if stream is not None else 2e-3
        # GLU: a bf16 step of gate or up (each rounded), then the activation's own rounding
        rtol = 2**-6 if ops.get("glu") else 2**-7
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
