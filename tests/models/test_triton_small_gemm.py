"""The small GEMMs of a few-row decode step's projections, under Triton's interpreter: against
torch's linear over ragged tiles, a bias, one to 16 rows; the ops a fused layer's GEMMs carry
against the unfused chain's torch ops; what they refuse, the tiling's knob, and a forward of
three rows whose layers take them. (On a GPU, in bf16, against cuBLAS:
tests/gpu/test_triton_small_gemm_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from models.attention.base import ForwardContext
from models.attention.torch_paged import TorchPagedAttention
from models.gemma3 import Gemma3Model
from models.kernels import fused_decode
from models.kernels.triton_gemv import gemv_reference
from models.kernels.triton_small_gemm import (
    MAX_ROWS,
    WIDE,
    WIDE_OUTPUTS,
    Normed,
    SmallGemmConfig,
    fits,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from tests.models.decode_step import cached_decode_step

pytest.importorskip("triton")


def linear(n: int, k: int, bias: bool, g: torch.Generator) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


# (rows of x, outputs, columns, bias, tiling): whole tiles, ragged outputs and columns, a bias,
# one row, the most rows
SHAPES = [
    (16, 64, 256, False, SmallGemmConfig(16, 64)),
    (5, 40, 200, True, SmallGemmConfig(32, 64, 2, 2)),
    (1, 33, 96, False, SmallGemmConfig(16, 32, 1, 1)),
    (MAX_ROWS, 17, 48, True, SmallGemmConfig(16, 256)),
]


@pytest.mark.parametrize("m,n,k,bias,config", SHAPES)
def test_the_small_gemm_is_torchs_linear(m, n, k, bias, config):
    g = torch.Generator().manual_seed(m * n * k)
    lin = linear(n, k, bias, g)
    x = torch.randn(m, k, generator=g)
    got = small_gemm(lin, x, config)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)
    # rows of a wider tensor (a strided view, unit column stride): the same
    wide = torch.randn(m, 2 * k, generator=g)
    torch.testing.assert_close(small_gemm(lin, wide[:, :k], config), lin(wide[:, :k]))


KINDS = ["pre", "into", "into+norm", "pre+glu", "glu"]


@pytest.mark.parametrize("m,n,k,bias,config", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_fused_kind_is_the_unfused_chain(m, n, k, bias, config, kind):
    """After an RMSNorm (x a Normed: 1 / rms applied to the sums), into the residual stream
    (handing the next norm its input), making SiLU * up (gate rows, then up rows): the
    kernel's roundings (small_gemm_reference), and in fp32 the unfused chain's torch ops
    (triton_gemv.gemv_reference)."""
    g = torch.Generator().manual_seed(m * n * k + len(kind))
    into, glu = kind.startswith("into"), kind.endswith("glu")
    lin = linear(k if into else 2 * n if glu else n, k, bias, g)
    x, r = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    norm = (1 + 0.1 * torch.randn(k, generator=g), 1e-5)
    if kind.startswith("pre"):
        got = small_gemm(lin, prenorm(x, *norm), config, glu=glu)
        want = small_gemm_reference(lin, x, pre=norm, glu=glu)
        chain = gemv_reference(lin, x, norm=norm, glu=glu)
        torch.testing.assert_close(want, chain, rtol=1e-5, atol=1e-5)
    elif kind == "glu":
        got, want = small_gemm(lin, x, config, glu=True), small_gemm_reference(lin, x, glu=True)
    else:
        stream = r.clone()
        ops = {"norm": norm} if kind == "into+norm" else {}
        got = small_gemm(lin, x, config, into=stream, **ops)
        want = small_gemm_reference(lin, x, into=r.clone(), **ops)
        if kind == "into+norm":  # the stream in place, and the next norm's input out
            want, rows = want
            assert isinstance(got, Normed) and got.eps == norm[1]
            torch.testing.assert_close(got.rows, rows, rtol=1e-5, atol=1e-5)
            squares = got.squares.sum(0)
            torch.testing.assert_close(squares[:m], want.pow(2).sum(-1), rtol=1e-5, atol=1e-5)
            assert (squares[m:] == 0).all()
            got = stream
        assert got is stream
    assert got.shape == want.shape == (m, k if into else n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prenorm_scales_the_rows_and_sums_their_squares():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 600, generator=g)  # two whole parts and a ragged one
    w = torch.randn(600, generator=g)
    normed = prenorm(x, w, 1e-6)
    assert normed.squares.shape == (3, MAX_ROWS) and normed.eps == 1e-6
    torch.testing.assert_close(normed.rows, x * w)
    torch.testing.assert_close(normed.squares.sum(0)[:5], x.pow(2).sum(-1))
    assert (normed.squares[:, 5:] == 0).all()


def test_bf16_rounds_about_where_the_chain_rounds():
    """In bf16: x times the norm's weight rounded before the products (the chain rounds the
    normalized row: a bf16 step apart at most), the output rounded before the residual's add
    and the add after it, gate_up's outputs before the activation."""
    g = torch.Generator().manual_seed(1)
    lin = linear(128, 512, False, g).bfloat16()
    sq = linear(512, 512, False, g).bfloat16()
    x, r = (torch.randn(5, 512, generator=g).bfloat16() for _ in range(2))
    norm = ((1 + 0.1 * torch.randn(512, generator=g)).bfloat16(), 1e-5)
    c = SmallGemmConfig(32, 128)
    stream = x * 30  # a residual stream far from unit scale
    for glu in (False, True):
        got = small_gemm(lin, prenorm(stream, *norm), c, glu=glu)
        want = gemv_reference(lin, stream, norm=norm, glu=glu)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got = small_gemm(sq, x, c, into=r.clone())
    want = gemv_reference(sq, x, into=r.clone())
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)


def test_what_it_refuses():
    g = torch.Generator().manual_seed(0)
    lin = linear(32, 64, False, g)
    assert fits(lin, torch.randn(MAX_ROWS, 64))
    assert not fits(lin, torch.randn(MAX_ROWS + 1, 64))  # too many rows
    assert not fits(lin, torch.randn(0, 64))
    assert not fits(lin, torch.randn(64, 4).t())  # columns not contiguous
    assert not fits(lin, torch.randn(4, 64, dtype=torch.float64))  # another dtype
    assert not fits(lin, torch.randn(4, 32))  # the wrong width
    t = linear(64, 32, False, g)
    with torch.no_grad():
        t.weight = torch.nn.Parameter(torch.randn(32, 64).t())  # a column-major weight
    assert not fits(t, torch.randn(4, 32))
    assert not fits(torch.nn.Identity(), torch.randn(4, 64))

    class Scaled(torch.nn.Linear):  # a linear that computes something else
        def forward(self, x):
            return 2 * super().forward(x)

    assert not fits(Scaled(64, 32), torch.randn(4, 64))
    ops = fused_decode.StepOps(small=SmallGemmConfig(16, 32))
    x = torch.randn(4, 64)
    s = Scaled(64, 32)
    torch.testing.assert_close(ops.linear(s, x), s(x))  # through its own forward
    with pytest.raises(AssertionError, match="at most 16 rows"):
        small_gemm(lin, torch.randn(MAX_ROWS + 1, 64))
    with pytest.raises(AssertionError, match="residual add"):  # a norm's input out of nothing
        small_gemm(lin, x, norm=(torch.ones(64), 1e-5))


def test_the_tiling_knob():
    assert SmallGemmConfig.parse("32:128") == SmallGemmConfig(32, 128, 4, 6)
    assert SmallGemmConfig.parse("16:64:2:3") == SmallGemmConfig(16, 64, 2, 3)
    assert str(SmallGemmConfig(16, 64, 2, 3)) == "16:64:2:3"
    # the default takes the wide tiling for wide projections; a given one applies as it is
    assert SmallGemmConfig().for_outputs(28672) == WIDE == SmallGemmConfig(64, 128, 4, 4)
    assert SmallGemmConfig().for_outputs(WIDE_OUTPUTS - 1) == SmallGemmConfig()
    assert SmallGemmConfig(32, 64).for_outputs(28672) == SmallGemmConfig(32, 64)
    for bad in ("8", "24:64", "16:64:3", "16:64:4:0", "16:64:4:2:1", "16:64/", "16/x", "/16"):
        with pytest.raises(ValueError, match="small GEMM"):
            SmallGemmConfig.parse(bad)
    # a wide projections' tiling after a '/': theirs, the narrow ones' the first
    both = SmallGemmConfig.parse("32:256:4:4/64:128:4:4")
    assert both == SmallGemmConfig(32, 256, 4, 4, wide=WIDE)
    assert str(both) == "32:256:4:4/64:128:4:4"
    assert both.for_outputs(28672) == WIDE and both.for_outputs(6144) is both
    assert SmallGemmConfig.parse("") == SmallGemmConfig()
    with pytest.raises(ValueError, match="wide tiling"):
        SmallGemmConfig(wide=both)


def test_load_step_ops_checks_the_small_gemm():
    ops, why = fused_decode.load_step_ops(torch.device("cpu"), small=SmallGemmConfig(16, 512))
    assert why is None and ops.small_config == SmallGemmConfig(16, 512)
    assert ops.gemv_config is None


@torch.no_grad()
def test_a_three_row_forward_runs_its_layers_as_fused_small_gemms():
    """The tiny Llama in bf16, a decode step of three rows over a cached prompt: every layer as
    four small GEMMs carrying its norms, residual adds and SiLU * up (the first layer's norm
    input made by prenorm from the embeddings, each later one's by the add before it),
    against the model's own forward."""
    lm, caches, saved, step, ids, pos, plain = cached_decode_step(3)
    cfg = lm.config
    calls, plain_calls = [], []

    class Counting(fused_decode.StepOps):
        def project(self, linear, x, **ops):
            kinds = ["normed"] if isinstance(x, Normed) else []
            calls.append(
                kinds + sorted(k for k, v in ops.items() if v is not None and v is not False)
            )
            return super().project(linear, x, **ops)

        def prenorm(self, x, weight, eps):
            calls.append(["prenorm"])
            return super().prenorm(x, weight, eps)

        def linear(self, linear, x):
            plain_calls.append(tuple(linear.weight.shape))
            return super().linear(linear, x)

    for c, s in zip(caches, saved):
        c.copy_(s)
    ops = Counting(small=SmallGemmConfig(16, 32))
    ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops)
    got = fused_decode.forward(lm.model, ids, pos, ctx, ops)
    layer = [["normed"], ["into", "norm"], ["normed", "glu"], ["into", "norm"]]
    last = [["normed"], ["into", "norm"], ["normed", "glu"], ["into"]]  # the final norm: its own
    assert calls == [["prenorm"]] + layer * (cfg.num_layers - 1) + last
    assert plain_calls == []
    rel = (got.float() - plain.float()).norm() / plain.float().norm()
    assert rel < 2e-2, float(rel)  # bf16 sums in another order, over the layers
    # one row with the GEMVs off: the small GEMMs too; a tensor-parallel shard's layers
    # (sums between the projections) keep the model's own, their projections small GEMMs
    assert ops.takes_layer(lm.model.model.layers[0], got[:1].contiguous(), True)
    assert not ops.takes_layer(lm.model.model.layers[0], got, False)


@pytest.mark.parametrize("kept", [0, 1], ids=["first-plain", "last-plain"])
@torch.no_grad()
def test_layers_of_small_gemms_and_plain_layers_hand_the_stream_over(kept):
    """A stack where one layer keeps its own forward (as a layer the kernels cannot take
    would): a small layer before it hands it the stream (its Normed dropped; the last plain
    layer's pair then goes to the final norm's add), a small layer after it takes its
    (output, stream) pair; the model's output as its own. A Gemma model is no stack of
    pre-norm layers: its graphs run its own forward."""
    lm, caches, saved, step, ids, pos, plain = cached_decode_step(3)
    assert lm.config.num_layers == 2
    own = lm.model.model.layers[kept]

    class SkippingOne(fused_decode.StepOps):
        def takes_layer(self, layer, x, whole):
            return layer is not own and super().takes_layer(layer, x, whole)

    ops = SkippingOne(small=SmallGemmConfig(16, 32))
    for c, s in zip(caches, saved):
        c.copy_(s)
    ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops)
    got = fused_decode.forward(lm.model, ids, pos, ctx, ops)
    rel = (got.float() - plain.float()).norm() / plain.float().norm()
    assert rel < 2e-2, float(rel)
    assert fused_decode.runs(lm.model) and not getattr(Gemma3Model, "pre_norm_stack", False)
