"""The one-row layer's GEMVs on the GPU (models.kernels.triton_gemv): each kind at
Llama-3.1-8B's shapes against the unfused chain's torch ops (cuBLAS's GEMM, rounded where the
chain rounds), plain and as programmatic dependent launches, and a dependent launch reads what
the kernel before it wrote. (The tokens of graphs that run them: test_cuda_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from tests.gpu.common import GPU
from tests.gpu.test_l2_prefetch_gpu import slow_write

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


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_is_the_unfused_chain(name, pdl):
    n, k, kind = KINDS[name]
    lin, x, ops, stream = case(n, k, kind, torch.Generator("cuda").manual_seed(n))
    for config in (GemvConfig(), GemvConfig(16, 256, 4, 1), GemvConfig(4, 2048, 8, 1)):
        into = {} if stream is None else {"into": stream.clone()}
        got = gemv(lin, x, config=config, pdl=pdl, **ops, **into)
        into = {} if stream is None else {"into": stream.clone()}
        want = gemv_reference(lin, x, **ops, **into)
        # fp32 sums in another order than cuBLAS's: the output one bf16 step apart at most
        # (2**-7 of it); into the stream, that step of the output (|y| < 4: 2**-5) is then
        # added to the stream's value, which may cancel it
        atol = 2**-5 if stream is not None else 2e-3
        # GLU: a bf16 step of gate or up (each rounded), then the activation's own rounding
        rtol = 2**-6 if ops.get("glu") else 2**-7
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_a_dependent_gemv_reads_what_the_kernel_before_it_wrote():
    """A slow GEMM writes the GEMV's input (the stream, h, the attention's output, gate_up)
    into zeros right before it; the dependent launch asks the L2 for its weights first, then
    waits: its output is the plain launch's, bit for bit, every time."""
    g = torch.Generator("cuda").manual_seed(0)
    sq = torch.nn.Linear(HIDDEN, HIDDEN, bias=False, device="cuda", dtype=torch.bfloat16)
    down = torch.nn.Linear(INTER, HIDDEN, bias=False, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(HIDDEN, device="cuda", generator=g).bfloat16()
    for it in range(6):
        got = {}
        for pdl in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(it)
            r, h = (torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            slow_write(r, gen)
            a = gemv(sq, r, norm=(nw, 1e-5), pdl=pdl)
            slow_write(h, gen)
            b = gemv(sq, r, norm=(nw, 1e-5), h=h, pdl=pdl)
            x = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
            stream = r.clone()
            slow_write(x, gen)
            stream = gemv(sq, x, into=stream, h=h, pdl=pdl)
            gu = torch.zeros(1, 2 * INTER, device="cuda", dtype=torch.bfloat16)
            slow_write(gu, gen)
            c = gemv(down, gu, silu=True, pdl=pdl)
            torch.cuda.synchronize()
            got[pdl] = (a, b, stream, c)
        for plain, dependent in zip(got[False], got[True]):
            assert torch.equal(plain, dependent)


def test_a_chain_of_dependent_gemvs_reads_each_output():
    """A layer's GEMVs as dependent launches, each reading the one before's output: each lets
    the next launch once its own wait is over, so the next may run beside its tail and must
    wait for all of it. Bit for bit the plain launches' output, every time (with SiLU * up out
    of gate_up's GEMV too)."""
    g = torch.Generator("cuda").manual_seed(1)

    def weight(n: int, k: int) -> torch.nn.Linear:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
        return lin

    qkv, o, gate_up, down = (
        weight(6144, HIDDEN),
        weight(HIDDEN, HIDDEN),
        weight(2 * INTER, HIDDEN),
        weight(HIDDEN, INTER),
    )
    nw = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).bfloat16()
    for it in range(6):
        got = {}
        for pdl in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(it)
            stream = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
            slow_write(stream, gen)
            q = gemv(qkv, stream, norm=(nw, 1e-5), pdl=pdl)
            stream = gemv(o, q[:, :HIDDEN].contiguous(), into=stream, pdl=pdl)
            act = gemv(gate_up, stream, norm=(nw, 1e-5), glu=True, pdl=pdl)
            h = gemv(down, act, pdl=pdl)
            gu = gemv(gate_up, h, norm=(nw, 1e-5), h=stream, pdl=pdl)
            h2 = gemv(down, gu, silu=True, pdl=pdl)
            torch.cuda.synchronize()
            got[pdl] = (q, stream, act, h, gu, h2)
        for plain, dependent in zip(got[False], got[True]):
            assert torch.equal(plain, dependent)
