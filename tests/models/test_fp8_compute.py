"""FP8 compute: torch._scaled_mm with per-token activation scales against a float64 reference
(the CPU's _scaled_mm takes row-wise scales too), which path a step takes (its rows, the device,
the layer's shape), and the Triton GEMVs and small GEMMs reading E4M3 weights under the
interpreter: each kind against the dequantized reference, and a tiny FP8 model's decode step
through the fused chain against its own forward. (On a GPU: tests/gpu/test_fp8_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.kernels import fp8_quant, fused_decode, triton_gemv
from models.kernels.fused_decode import StepOps
from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from models.kernels.triton_small_gemm import (
    SmallGemmConfig,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from models.layers import fp8_linear as fl
from models.layers.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    fp8_dequant_linear,
    fp8_linear,
    fp8_scaled_mm,
    quantize_rows,
    scaled_mm_runs,
    scaled_mm_takes,
    use_scaled_mm,
)
from models.loader import load_model
from models.quantization import quantize_fp8

pytest.importorskip("triton")

# E4M3 rounds a value of the normal range within 2**-4 of itself, a subnormal (steps of 2**-9
# of the scale) within 2**-10 of the scale. The CPU's _scaled_mm (oneDNN) rounds more than the
# output's bf16 (2**-9): its results lie within 2**-8 of the float64 product of its operands
# (0.0037 the worst seen); the GPU's bound is tests/gpu/test_fp8_gpu.py's
E4M3_REL, E4M3_SUB, SCALED_MM_REL = 2.0**-4, 2.0**-10, 2.0**-7


def fp8_layer(n: int, k: int, bias: bool, g: torch.Generator, dtype=torch.bfloat16) -> Fp8Linear:
    """An Fp8Linear of k -> n, its weight of unit-scale outputs quantized per row."""
    layer = Fp8Linear(k, n, bias, dtype)
    q, s = quantize_fp8(torch.randn(n, k, generator=g) * k**-0.5)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g).to(dtype))
    return layer


def dequantized(layer: Fp8Linear) -> torch.Tensor:
    return layer.weight.double() * layer.weight_scale.double()[:, None]


# ---------------------------------------------------------------- torch._scaled_mm


QUANT_CASES = [
    (6, 200, torch.bfloat16),
    (3, 3000, torch.bfloat16),
    (4, 4096, torch.float32),
    (2, fp8_quant.MAX_K + 3000, torch.bfloat16),  # wider than a block: the loop's two reads
]


@pytest.mark.parametrize(("rows", "k", "dtype"), QUANT_CASES)
def test_the_fused_quantizer_computes_torchs_scales_and_quotients(rows, k, dtype):
    """The one-kernel quantizer (models.kernels.fp8_quant, a GPU's) under the interpreter: each
    token's scale and quotient bit for bit torch's, over rows held in one block and rows wider
    than a block, an all-zero row and an outlier; the cast (left out here: the interpreter's is
    wrong) rounds them to torch's E4M3 bytes."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 1.5, rows)[:, None]
    x[1] = 0
    x[-1, k // 2] = 500.0
    x = x.to(dtype)
    want_q, want_s = quantize_rows(x)
    q32, s = fp8_quant.quantize_rows(x, out_f32=True)
    assert torch.equal(s, want_s)
    assert torch.equal(q32, x.float() / want_s)
    assert torch.equal(q32.to(FP8_DTYPE).view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_rows_scales_each_token_by_its_amax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=g) * torch.tensor([1e-3, 1, 30, 1, 1, 1])[:, None]
    x[3] = 0  # an all-zero token
    x[4, 17] = 500.0  # an outlier: the rest of its row in E4M3's small values
    x = x.bfloat16()
    xq, s = quantize_rows(x)
    assert xq.dtype == FP8_DTYPE and xq.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (6, 1)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    live = amax[:, 0] > 0
    torch.testing.assert_close(s[live], amax[live] * (1.0 / FP8_MAX), rtol=0, atol=0)
    assert xq[3].float().eq(0).all() and s[3] > 0  # zeros stay zeros
    # each token's largest value lands on 448, and every value within E4M3's bound
    assert xq[live].float().abs().amax(dim=1).eq(FP8_MAX).all()
    back = xq.double() * s.double()
    bound = torch.maximum(E4M3_REL * x.double().abs(), E4M3_SUB * s.double())
    assert ((back - x.double()).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_is_the_float64_product_within_its_bound(rows, bias):
    """fp8_scaled_mm against (1) the float64 product of the operands it was given (the
    quantized tokens and weight): within the kernel's own rounding (SCALED_MM_REL); (2) the
    float64 product of x itself and the dequantized weight: within E4M3's rounding of each
    token's values (2**-4 of each |x_k w_k| in the normal range, 2**-10 of the token's scale
    times |w_k| below it) plus the kernel's."""
    g = torch.Generator().manual_seed(rows)
    layer = fp8_layer(48, 96, bias, g)
    x = (torch.randn(rows, 96, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
    got = fp8_scaled_mm(x, layer.weight, layer.weight_scale, layer.bias).double()
    assert got.shape == (rows, 48)
    w = dequantized(layer)
    b = layer.bias.double() if bias else 0.0
    xq, xs = quantize_rows(x)
    exact_q = (xq.double() * xs.double()) @ w.T + b
    tol = SCALED_MM_REL * exact_q.abs() + 1e-3
    assert ((got - exact_q).abs() <= tol).all(), float(((got - exact_q).abs() / tol).max())
    exact = x.double() @ w.T + b
    e4m3 = E4M3_REL * (x.double().abs() @ w.abs().T) + E4M3_SUB * xs.double() * w.abs().sum(1)
    bound = e4m3 + SCALED_MM_REL * exact.abs() + 1e-3
    err = (got - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 0  # the tokens were rounded: a bound that has something to bound


def test_fp8_linear_takes_scaled_mm_from_its_threshold(monkeypatch):
    calls = []
    real = fl.fp8_scaled_mm

    def counting(x, *a, swap=False):
        calls.append((x.shape[0], swap))
        return real(x, *a, swap=swap)

    monkeypatch.setattr(fl, "fp8_scaled_mm", counting)
    g = torch.Generator().manual_seed(1)
    layer = fp8_layer(32, 64, True, g)
    w, s, b = layer.weight, layer.weight_scale, layer.bias
    for rows, min_rows, swap_max, how in (
        (3, 4, 0, None), (4, 4, 0, False), (9, 4, 0, False), (9, None, 16, None),
        (9, 1, 16, True), (16, 1, 16, True), (17, 1, 16, False),
    ):  # fmt: skip
        x = torch.randn(rows, 64, generator=g).bfloat16()
        calls.clear()
        got = fp8_linear(x, w, s, b, min_rows, swap_max)
        want = fp8_dequant_linear(x, w, s, b) if how is None else real(x, w, s, b, swap=how)
        assert calls == ([] if how is None else [(rows, how)]), (rows, min_rows, swap_max)
        assert got.equal(want), (rows, min_rows, swap_max)
    # float32 activations: the row-wise FP8 kernels write bf16 only, so the dequantized path
    calls.clear()
    x = torch.randn(9, 64, generator=g)
    assert fp8_linear(x, w, s, b.float(), 1).equal(fp8_dequant_linear(x, w, s, b.float()))
    assert calls == []


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_the_swapped_scaled_mm_is_the_same_product(rows, bias):
    """y.T = W @ x.T (the few tokens padded to 16, the narrow side): the same products as
    _scaled_mm's usual order, summed in another order, so within bf16's rounding of the
    output (a bias is added after that rounding: a second one); contiguous [T, N]."""
    g = torch.Generator().manual_seed(rows)
    layer = fp8_layer(48, 64, bias, g)
    w, s, b = layer.weight, layer.weight_scale, layer.bias
    x = torch.randn(rows, 64, generator=g).bfloat16()
    got = fl.fp8_scaled_mm(x, w, s, b, swap=True)
    want = fl.fp8_scaled_mm(x, w, s, b)
    assert got.shape == (rows, 48) and got.is_contiguous() and got.dtype == torch.bfloat16
    top = float(want.float().abs().max())
    torch.testing.assert_close(got, want, rtol=2**-7, atol=top * 2**-8 if bias else 1e-6)


def test_use_scaled_mm_decides_once_per_layer(monkeypatch):
    """On the CPU every layer keeps the dequantized path; on a GPU that runs _scaled_mm (a
    stand-in here: the CPU's _scaled_mm computes what it computes) the layers of bf16 and
    K, N multiples of 16 take it from their threshold on, asking no device in a step."""
    lm = load_model("dummy:tiny-llama", dtype=torch.bfloat16, quantization="fp8")
    layers = [m for m in lm.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * lm.config.num_layers
    assert not scaled_mm_runs(torch.device("cpu"))
    assert use_scaled_mm(lm.model, torch.device("cpu"), 1) == 0
    assert all(m.scaled_mm_min_rows is None for m in layers)
    # a GPU of compute capability >= 8.9
    monkeypatch.setattr(fl, "scaled_mm_runs", lambda device: device.type == "cuda")
    cuda = torch.device("cuda")
    assert use_scaled_mm(lm.model, cuda, 16) == len(layers)
    assert all(m.scaled_mm_min_rows == 16 for m in layers)
    assert use_scaled_mm(lm.model, cuda, None) == 0  # the table's null: never
    g = torch.Generator().manual_seed(2)
    assert scaled_mm_takes(fp8_layer(32, 64, False, g), runs=True)
    assert not scaled_mm_takes(fp8_layer(32, 64, False, g), runs=False)
    assert not scaled_mm_takes(fp8_layer(32, 40, False, g), runs=True)  # K of 40
    assert not scaled_mm_takes(fp8_layer(24, 64, False, g), runs=True)  # N of 24
    assert not scaled_mm_takes(fp8_layer(32, 64, False, g, torch.float16), runs=True)
    # a model's steps: 16 rows and more through _scaled_mm (swapped up to 24 rows), fewer
    # through the dequantized path
    use_scaled_mm(lm.model, cuda, 16, 24)
    assert all(m.swap_max_rows == 24 for m in layers)
    calls = []
    real = fl.fp8_scaled_mm

    def counting(x, *a, swap=False):
        calls.append((len(x), swap))
        return real(x, *a, swap=swap)

    monkeypatch.setattr(fl, "fp8_scaled_mm", counting)
    o_proj = lm.model.model.layers[0].self_attn.o_proj
    for rows in (15, 16, 40):
        o_proj(torch.randn(rows, o_proj.in_features, generator=g).bfloat16())
    assert calls == [(16, True), (40, False)]


# ---------------------------------------------------------------- Triton GEMVs, small GEMMs


GEMV_KINDS = ["plain", "norm+h", "silu", "into+h", "norm+glu"]


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("load", [16, 8])
def test_the_fp8_gemv_is_the_dequantized_chain(kind, bias, load, monkeypatch):
    """Each kind of GEMV over an FP8 weight (float32 compute: exact products under the
    interpreter) against the reference over the dequantized weight, a ragged tile; its weight
    loads of 16 or 8 values (triton_gemv.FP8_LOAD: the same columns in another grouping)."""
    monkeypatch.setattr(triton_gemv, "FP8_LOAD", load)
    g = torch.Generator().manual_seed(len(kind) + bias)
    n, k = 40, 200
    glu, into = kind.endswith("glu"), kind.startswith("into")
    layer = fp8_layer(k if into else 2 * n if glu else n, k, bias, g, torch.float32)
    x = torch.randn(1, 2 * k if kind == "silu" else k, generator=g)
    ops: dict = {"h": torch.randn(1, k, generator=g) if kind.endswith("+h") else None}
    if kind.startswith("norm"):
        ops["norm"] = (1 + 0.1 * torch.randn(k, generator=g), 1e-5)
    ops.update(silu=kind == "silu", glu=glu)
    r = torch.randn(1, k, generator=g)
    got = gemv(layer, x, config=GemvConfig(8, 64), **ops, **({"into": r.clone()} if into else {}))
    want = gemv_reference(layer, x, **ops, **({"into": r.clone()} if into else {}))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind == "plain":  # the module's own forward (the dequantized weight)
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


def test_the_fp8_gemv_in_bf16_is_the_modules_forward():
    g = torch.Generator().manual_seed(3)
    layer = fp8_layer(96, 256, True, g)
    x = torch.randn(1, 256, generator=g).bfloat16()
    got = gemv(layer, x, config=GemvConfig(16, 128))
    assert got.dtype == torch.bfloat16
    # one rounding of the fp32 sum where the module rounds its product, then its scaling
    torch.testing.assert_close(got.float(), layer(x).float(), rtol=2e-2, atol=2e-2)


SMALL_KINDS = ["plain", "pre", "into+norm", "pre+glu"]


@pytest.mark.parametrize("kind", SMALL_KINDS)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_the_fp8_small_gemm_is_the_dequantized_chain(kind, m):
    g = torch.Generator().manual_seed(m * len(kind))
    n, k = 40, 96
    into, glu = kind.startswith("into"), kind.endswith("glu")
    layer = fp8_layer(k if into else 2 * n if glu else n, k, m == 5, g, torch.float32)
    x = torch.randn(m, k, generator=g)
    norm = (1 + 0.1 * torch.randn(k, generator=g), 1e-5)
    c = SmallGemmConfig(16, 32)
    if kind == "plain":
        got = small_gemm(layer, x, c)
        torch.testing.assert_close(got, small_gemm_reference(layer, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
    elif kind.startswith("pre"):
        got = small_gemm(layer, prenorm(x, *norm), c, glu=glu)
        want = small_gemm_reference(layer, x, pre=norm, glu=glu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        r = torch.randn(m, k, generator=g)
        got = small_gemm(layer, x, c, into=(stream := r.clone()), norm=norm)
        want, rows = small_gemm_reference(layer, x, into=r.clone(), norm=norm)
        torch.testing.assert_close(stream, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.rows, rows, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the fused decode chain


def test_fp8_layers_take_the_fused_decode_kernels_where_checked():
    """A decode graph's step ops take FP8 projections where their FP8 checks passed (`fp8`):
    one row's GEMVs always, the small GEMMs of more rows where `fp8_small`; otherwise an FP8
    layer keeps its module."""
    bf16 = load_model("dummy:tiny-llama", dtype=torch.bfloat16).model
    fp8 = load_model("dummy:tiny-llama", dtype=torch.bfloat16, quantization="fp8").model
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    layer = fp8.model.layers[0]
    for rows in (1, 4):
        xs = x.expand(rows, -1).contiguous()
        assert StepOps(GemvConfig(), SmallGemmConfig()).takes_layer(bf16.model.layers[0], xs, True)
        assert not StepOps(GemvConfig(), SmallGemmConfig()).takes_layer(layer, xs, True)
        both = StepOps(GemvConfig(), SmallGemmConfig(), fp8=True, fp8_small=True)
        assert both.takes_layer(layer, xs, True)
        assert not both.takes_layer(layer, xs.float(), True)  # float32: not a GPU's dtype
        gemvs = StepOps(GemvConfig(), SmallGemmConfig(), fp8=True)
        assert gemvs.takes_layer(layer, xs, True) == (rows == 1)
    o_proj = layer.self_attn.o_proj
    assert StepOps(small=SmallGemmConfig(), fp8=False).linear(o_proj, x).equal(o_proj(x))
    assert StepOps(small=SmallGemmConfig(), fp8=True).linear(o_proj, x).equal(o_proj(x))
    got = StepOps(small=SmallGemmConfig(16, 32), fp8=True, fp8_small=True).linear(o_proj, x)
    assert not got.equal(o_proj(x))  # a small GEMM's one rounding, not the module's two
    torch.testing.assert_close(got.float(), o_proj(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3])
@torch.no_grad()
def test_a_fused_decode_step_of_an_fp8_model_is_its_own_forward(rows):
    """A decode graph's step of the tiny FP8 Llama through fused_decode.forward: with the FP8
    kernels every projection of every layer runs a GEMV (one row) or a small GEMM (three),
    reading the E4M3 weights, and the step is the model's forward within bf16's roundings;
    without them no FP8 projection reaches a kernel and the step is the forward exactly."""
    lm = load_model("dummy:tiny-llama", dtype=torch.bfloat16, quantization="fp8")
    cfg, cpu = lm.config, torch.device("cpu")
    caches = [
        torch.zeros(3, 2, 4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        for _ in range(cfg.num_layers)
    ]
    prompt = AttentionMetadata.build([SeqChunk(0, 5, [1, 2])], 4, cpu)
    lm.model(torch.tensor([5, 17, 200, 3, 99]), torch.arange(5), ForwardContext(
        attn=TorchPagedAttention(caches, prompt)))  # fmt: skip
    saved = [c.clone() for c in caches]
    step = AttentionMetadata.build([SeqChunk(5, rows, [1, 2])], 4, cpu)
    ids, pos = torch.tensor([42, 7, 8][:rows]), torch.arange(5, 5 + rows)
    plain = lm.model(ids, pos, ForwardContext(attn=TorchPagedAttention(caches, step)))
    kernels = []

    class Counting(StepOps):
        def project(self, linear, x, **ops):
            kernels.append(linear)
            return super().project(linear, x, **ops)

    for fp8 in (False, True):
        kernels.clear()
        for c, s in zip(caches, saved):
            c.copy_(s)
        ops = Counting(GemvConfig(8, 64), SmallGemmConfig(16, 32), fp8=fp8, fp8_small=fp8)
        ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops)
        got = fused_decode.forward(lm.model, ids, pos, ctx, ops)
        if not fp8:
            assert kernels == [] and got.equal(plain)
            continue
        layers = lm.model.model.layers
        want = [p for ly in layers for p in (ly.self_attn.qkv_proj, ly.self_attn.o_proj,
                                             ly.mlp.gate_up_proj, ly.mlp.down_proj)]  # fmt: skip
        assert kernels == want and all(isinstance(p, Fp8Linear) for p in kernels)
        rel = (got.float() - plain.float()).norm() / plain.float().norm()
        assert 0 < rel < 2e-2, float(rel)  # bf16 roundings elsewhere, over the layers


def test_load_step_ops_checks_the_fp8_kernels_apart(monkeypatch):
    """The FP8 checks pass under the interpreter (it loads E4M3); where they fail, the bf16
    kernels stay and FP8 layers keep their modules."""
    ops, why = fused_decode.load_step_ops(torch.device("cpu"), GemvConfig(32, 512))
    assert why is None and ops.fp8

    def failing(*a):
        raise RuntimeError("no E4M3 here")

    monkeypatch.setattr(fused_decode, "_fp8_checks", failing)
    ops, why = fused_decode.load_step_ops(torch.device("cpu"), GemvConfig(32, 512))
    assert why is None and ops is not None and not ops.fp8
