"""The GEMVs that carry a one-row layer's norms, activation and residual adds, under Triton's
interpreter: each kind against the unfused chain's torch ops (its roundings), ragged tiles, a
bias, the tiling's knob, and a forward whose layers take them. (On a GPU, in bf16, with PDL:
tests/gpu/test_triton_gemv_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.kernels import fused_decode
from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from tests.models.decode_step import BLOCK, cached_decode_step

pytest.importorskip("triton")


def linear(n: int, k: int, bias: bool, g: torch.Generator, dtype=torch.float32):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


# (rows, columns, bias, tiling): whole tiles, ragged rows and columns, a bias, one row a program,
# the norm read in one pass
SHAPES = [
    (64, 256, False, GemvConfig(8, 64)),
    (40, 200, True, GemvConfig(16, 128, 2, 1)),
    (7, 96, False, GemvConfig(1, 32, 1, 2)),
    (40, 200, True, GemvConfig(16, 64, 2, 2, one_pass=True)),
]


@pytest.mark.parametrize("n,k,bias,config", SHAPES)
@pytest.mark.parametrize(
    "kind", ["plain", "norm", "norm+h", "silu", "into", "into+h", "norm+glu", "plain+glu"]
)
def test_each_kind_is_the_unfused_chain(n, k, bias, config, kind):
    g = torch.Generator().manual_seed(n * k)
    into = kind.startswith("into")
    glu = kind.endswith("glu")
    if glu and config.block_n < 2:
        pytest.skip("a GLU program takes a gate row and its up row")
    lin = linear(k if into else 2 * n if glu else n, k, bias, g)
    x = torch.randn(1, 2 * k if kind == "silu" else k, generator=g)
    h = torch.randn(1, k, generator=g) if kind.endswith("+h") else None
    ops: dict = {"h": h}
    if kind.startswith("norm"):
        ops["norm"] = (1 + 0.1 * torch.randn(k, generator=g), 1e-5)
    if kind == "silu":
        ops["silu"] = True
    if glu:  # the activation of gate_up's outputs, [1, n]
        ops["glu"] = True
    r = torch.randn(1, k, generator=g)
    got = gemv(lin, x, config=config, **ops, **({"into": r.clone()} if into else {}))
    want = gemv_reference(lin, x, **ops, **({"into": r.clone()} if into else {}))
    assert got.shape == want.shape == (1, k if into else n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if into:  # in place: the stream's tensor holds the sum
        stream = r.clone()
        assert gemv(lin, x, config=config, into=stream, h=h) is stream


def test_bf16_rounds_where_the_chain_rounds():
    """In bf16 the normalized row and the activation are rounded before the products, the
    output before the residual's add, and each add after it (the interpreter rounds toward
    zero, torch to nearest: a bf16 step apart at most)."""
    g = torch.Generator().manual_seed(1)
    lin = linear(128, 512, False, g, torch.bfloat16)
    x, h, r = (torch.randn(1, 512, generator=g).bfloat16() for _ in range(3))
    nw = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    got = gemv(lin, x, norm=(nw, 1e-5), h=h, config=GemvConfig(16, 128))
    want = gemv_reference(lin, x, norm=(nw, 1e-5), h=h)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # in one pass the row scaled by the norm's weight is rounded, 1 / rms scales the sums
    one_pass = GemvConfig(16, 128, one_pass=True)
    got = gemv(lin, x, norm=(nw, 1e-5), h=h, config=one_pass)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    sq = linear(512, 512, False, g, torch.bfloat16)
    got = gemv(sq, x, into=r.clone(), h=h, config=GemvConfig(16, 128))
    want = gemv_reference(sq, x, into=r.clone(), h=h)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)
    # GLU: gate_up's outputs rounded, then the activation (the silu GEMV's input, as it is)
    got = gemv(lin, x, norm=(nw, 1e-5), glu=True, config=GemvConfig(16, 128))
    want = gemv_reference(lin, x, norm=(nw, 1e-5), glu=True)
    assert got.shape == (1, 64) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_tiling_knob():
    assert GemvConfig.parse("16:256") == GemvConfig(16, 256, 4, 2)
    assert GemvConfig.parse("8:512:8:1") == GemvConfig(8, 512, 8, 1)
    assert str(GemvConfig(8, 512, 8, 1)) == "8:512:8:1"
    assert GemvConfig.parse("8:512:8:1:1") == GemvConfig(8, 512, 8, 1, True)
    assert str(GemvConfig(8, 512, 8, 1, True)) == "8:512:8:1:1"
    for bad in ("12", "8:300", "8:512:3", "8:512:4:0", "1:2:4:1:5", "1:2:4:1:1:1"):
        with pytest.raises(ValueError, match="GEMV"):
            GemvConfig.parse(bad)


@pytest.mark.slow
def test_load_step_ops_checks_the_gemvs():
    ops, why = fused_decode.load_step_ops(torch.device("cpu"), gemv=GemvConfig(32, 512))
    assert why is None and ops.gemv_config == GemvConfig(32, 512) and ops.small_config is None
    assert ops.glu  # gate_up's GEMV makes SiLU * up
    # a program of one row cannot pair a gate row with its up row: the activation stays apart
    ops, why = fused_decode.load_step_ops(torch.device("cpu"), gemv=GemvConfig(1, 512))
    assert why is None and not ops.glu
    ops, why = fused_decode.load_step_ops(torch.device("cpu"))
    assert ops is None and why == "no GEMV or small GEMM tiling"


@torch.no_grad()
@pytest.mark.slow
def test_a_one_row_forward_runs_its_layers_as_gemvs():
    """The tiny Llama in bf16, one decode row over a cached prompt: every layer as four GEMVs
    (the first layer's stream the embeddings), against the model's own forward; a step of two
    rows keeps the model's own layers."""
    lm, caches, saved, step, ids, pos, plain = cached_decode_step(1)
    cfg, bs = lm.config, BLOCK
    calls = []

    class Counting(fused_decode.StepOps):
        def project(self, linear, x, **ops):
            calls.append(sorted(k for k, v in ops.items() if v is not None and v is not False))
            return super().project(linear, x, **ops)

    for c, s in zip(caches, saved):
        c.copy_(s)
    # one row a program: the down GEMV makes SiLU * up from gate_up's outputs
    ops = Counting(gemv=GemvConfig(1, 32))
    assert not ops.glu
    assert fused_decode.runs(lm.model)
    ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops)
    got = fused_decode.forward(lm.model, ids, pos, ctx, ops)
    first = [["norm"], ["into"], ["norm"], ["silu"]]  # the stream: the embeddings, no h yet
    later = [["h", "norm"], ["h", "into"], ["norm"], ["silu"]]
    assert calls == first + later * (cfg.num_layers - 1)
    rel = (got.float() - plain.float()).norm() / plain.float().norm()
    assert rel < 2e-2, float(rel)  # bf16 sums in another order, over the layers
    # glu: the activation made by gate_up's GEMV, the down GEMV a plain one
    calls.clear()
    for c, s in zip(caches, saved):
        c.copy_(s)
    ops = Counting(gemv=GemvConfig(8, 32))
    ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops)
    glu = fused_decode.forward(lm.model, ids, pos, ctx, ops)
    first = [["norm"], ["into"], ["glu", "norm"], []]
    later = [["h", "norm"], ["h", "into"], ["glu", "norm"], []]
    assert calls == first + later * (cfg.num_layers - 1)
    torch.testing.assert_close(glu, got, rtol=0, atol=0)  # the same roundings, bit for bit
    # two rows: the layers' own path, FlashInfer's (here torch's) norms
    calls.clear()
    two = AttentionMetadata.build([SeqChunk(5, 2, [1, 2])], bs, torch.device("cpu"))
    ctx = ForwardContext(attn=TorchPagedAttention(caches, two), step_ops=ops)
    fused_decode.forward(lm.model, torch.tensor([42, 7]), torch.tensor([5, 6]), ctx, ops)
    assert calls == []
