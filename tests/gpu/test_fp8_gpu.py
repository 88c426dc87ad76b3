"""FP8 weights on a GPU: the layer's dequantized matmul; torch._scaled_mm with per-token
activation scales against a float64 reference, and which layers take it; the Triton GEMVs and
small GEMMs reading E4M3 weights at Llama-3.1-8B's shapes against the dequantized chain; an FP8
model's decode graphs (those kernels in them) against its eager steps' tokens; and an FP8 model
served by the engine with half the weight bytes, the same tokens after an eviction and an
activation, exact accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.kernels import fp8_quant
from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from models.kernels.triton_small_gemm import (
    SmallGemmConfig,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from models.kernels.tuning import KernelConfig
from models.layers.fp8_linear import (
    Fp8Linear,
    fp8_dequant_linear,
    fp8_linear,
    fp8_scaled_mm,
    quantize_rows,
    scaled_mm_runs,
    use_scaled_mm,
)
from models.loader import init_dummy_weights, meta_model
from models.quantization import dequantize_fp8, quantize_fp8
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.request import FinishReason
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import (
    GPU,
    TINY,
    assert_logits_close,
    assert_no_real_divergence,
    cuda_pool,
    greedy,
    model_engine,
    prompts,
)

pytestmark = GPU
needs_fp8_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torch._scaled_mm and Triton's E4M3 need compute capability 8.9",
)
HIDDEN, INTER = 4096, 14336


def fp8_layer(n: int, k: int, g: torch.Generator, bias: bool = False) -> Fp8Linear:
    """An Fp8Linear of k -> n on the GPU, bf16, its weight of unit-scale outputs."""
    layer = Fp8Linear(k, n, bias, torch.bfloat16).cuda()
    q, s = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        if bias:
            layer.bias.copy_(torch.randn(n, device="cuda", generator=g).bfloat16())
    return layer


MODEL = "dummy:llama-3.2-1b"  # head_dim 64: a FlashInfer module the carried set holds


def test_the_fp8_matmul_is_the_dequantized_weights_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 2048, device="cuda", generator=g, dtype=torch.float32)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.device.type == "cuda"
    for rows in (1, 16, 300):
        x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
        want = F.linear(x.float(), dequantize_fp8(q, scale, torch.float32))
        got = fp8_linear(x, q, scale, None)
        assert got.dtype == torch.bfloat16
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, (rows, err.item())


@needs_fp8_mm
@pytest.mark.parametrize("k", [HIDDEN, INTER, 1000])
def test_the_fused_quantizer_gives_torchs_bytes(k):
    """The one-kernel per-token quantizer, the GPU's: scales and E4M3 bytes torch's own."""
    g = torch.Generator(device="cuda").manual_seed(k)
    x = (
        torch.randn(33, k, device="cuda", generator=g)
        * torch.logspace(-3, 1.5, 33, device="cuda")[:, None]
    )
    x[1] = 0
    x = x.bfloat16()
    want_q, want_s = quantize_rows(x)
    q, s = fp8_quant.quantize_rows(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@needs_fp8_mm
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_is_the_float64_product_within_its_bound(bias):
    """fp8_scaled_mm at the 8B's qkv shape (its operands swapped too, for a few rows) against
    the float64 product of x and the dequantized weight: within E4M3's rounding of each
    token's values (2**-4 of each |x_k w_k|, 2**-10 of the token's scale times |w_k| below
    E4M3's normal range) plus the output's bf16 rounding (2**-8 of it: fp32 sums rounded
    once) and the fp32 sums' own."""
    assert scaled_mm_runs(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    layer = fp8_layer(6144, HIDDEN, g, bias)
    w = layer.weight.double() * layer.weight_scale.double()[:, None]
    for rows, swap in ((1, False), (16, False), (300, False), (1024, False), (1, True),
                       (5, True), (16, True), (17, True)):  # fmt: skip
        x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
        got = fp8_scaled_mm(x, layer.weight, layer.weight_scale, layer.bias, swap=swap)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 6144)
        assert got.is_contiguous()
        _, xs = quantize_rows(x)
        b = layer.bias.double() if bias else 0.0
        exact = x.double() @ w.T + b
        mags = x.double().abs() @ w.abs().T
        bound = 2**-4 * mags + 2**-10 * xs.double() * w.abs().sum(1) + 2**-8 * exact.abs()
        bound += 1e-5 * mags + 1e-3
        if swap and bias:  # the bias added after the product's rounding: a second one
            bound += 2**-8 * (exact - b).abs()
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), (rows, swap, float((err / bound).max()))
        # E4M3's rounding of Gaussian tokens (amax / 448 a step, the small values subnormal):
        # 2.6% of the product's norm at this width, as the CPU's kernel gives it
        assert (err.norm() / exact.norm()) < 4e-2


@needs_fp8_mm
def test_the_layers_take_scaled_mm_from_the_tables_rows():
    """use_scaled_mm on the GPU: every projection of the 8B's multiples of 16 takes it from the
    threshold on; a layer whose K is not a multiple of 16 keeps the dequantized weight."""
    g = torch.Generator(device="cuda").manual_seed(1)
    model = torch.nn.ModuleDict({"a": fp8_layer(1024, HIDDEN, g), "b": fp8_layer(1024, 1000, g)})
    assert use_scaled_mm(model, torch.device("cuda"), 4) == 1
    a, b = model["a"], model["b"]
    assert a.scaled_mm_min_rows == 4 and b.scaled_mm_min_rows is None
    for rows in (3, 4):
        x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
        want = fp8_scaled_mm if rows >= 4 else fp8_dequant_linear
        assert a(x).equal(want(x, a.weight, a.weight_scale, a.bias))
    x = torch.randn(8, 1000, device="cuda", generator=g).bfloat16()
    assert b(x).equal(fp8_dequant_linear(x, b.weight, b.weight_scale, b.bias))


GEMV_KINDS = {  # name -> (out, in, the ops)
    "qkv after add + norm": (6144, HIDDEN, "norm+h"),
    "o into the stream (+ h)": (HIDDEN, HIDDEN, "into+h"),
    "gate_up making SiLU * up": (2 * INTER, HIDDEN, "norm+glu"),
    "down after SiLU * up": (HIDDEN, INTER, "silu"),
}


@needs_fp8_mm
@pytest.mark.parametrize("name", list(GEMV_KINDS))
def test_the_fp8_gemv_is_the_dequantized_chain(name):
    n, k, kind = GEMV_KINDS[name]
    g = torch.Generator(device="cuda").manual_seed(n + k)
    layer = fp8_layer(n, k, g, bias=kind == "norm+h")
    x = torch.randn(1, 2 * k if kind == "silu" else k, device="cuda", generator=g).bfloat16()
    ops: dict = {"h": None}
    if "+h" in kind:
        ops["h"] = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    if kind.startswith("norm"):
        ops["norm"] = ((1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16(), 1e-5)
    ops.update(silu=kind == "silu", glu=kind.endswith("glu"))
    stream = torch.randn(1, n, device="cuda", generator=g).bfloat16() if "into" in kind else None
    for config in (GemvConfig(), GemvConfig(16, 256, 4, 1)):
        into = {} if stream is None else {"into": stream.clone()}
        got = gemv(layer, x, config=config, **ops, **into)
        into = {} if stream is None else {"into": stream.clone()}
        want = gemv_reference(layer, x, **ops, **into)
        # fp32 sums in another order: a bf16 step of the output (|y| < 4: 2**-6) at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-5)


@needs_fp8_mm
@pytest.mark.parametrize("rows", [2, 5, 16])
def test_the_fp8_small_gemm_is_the_dequantized_chain(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    norm = ((1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).bfloat16(), 1e-5)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    qkv, o = fp8_layer(6144, HIDDEN, g, bias=True), fp8_layer(HIDDEN, HIDDEN, g)
    gate_up, down = fp8_layer(2 * INTER, HIDDEN, g), fp8_layer(HIDDEN, INTER, g)
    c = SmallGemmConfig()
    close = dict(rtol=2**-7, atol=2**-5)
    got = small_gemm(qkv, prenorm(x, *norm), c)
    torch.testing.assert_close(got.float(), small_gemm_reference(qkv, x, pre=norm).float(), **close)
    got = small_gemm(gate_up, prenorm(x, *norm), c, glu=True)
    want = small_gemm_reference(gate_up, x, pre=norm, glu=True)
    torch.testing.assert_close(got.float(), want.float(), **close)
    act = torch.randn(rows, INTER, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(small_gemm(down, act, c).float(), down(act).float(), **close)
    r = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    got = small_gemm(o, x, c, into=(stream := r.clone()), norm=norm)
    want, scaled = small_gemm_reference(o, x, into=r.clone(), norm=norm)
    torch.testing.assert_close(stream.float(), want.float(), **close)
    torch.testing.assert_close(got.rows.float(), scaled.float(), **close)


def tiny_fp8_model(seed: int = 0):
    """The GPU tests' tiny Llama (8 query heads over 2 KV heads) with FP8 projections, bf16
    otherwise, on the GPU."""
    cfg = ModelConfig.from_hf(dict(TINY, num_attention_heads=8))
    model = meta_model(cfg, torch.bfloat16, "fp8").to_empty(device="cuda")
    init_dummy_weights(model, seed, std=0.05)
    return cfg, model.eval().requires_grad_(False)


@needs_fp8_mm
def test_an_fp8_models_decode_graphs_give_the_eager_tokens():
    """Decode graphs of 1, 3 (padded to 4) and 16 rows whose layers run the FP8 GEMVs and small
    GEMMs (`fp8_small_gemm`), against the eager engine's steps over the dequantized weights (no
    _scaled_mm on either side: the weights alone are FP8)."""
    cfg, model = tiny_fp8_model()
    _, eager_model = tiny_fp8_model()  # a model each: a runner sets its layers' paths
    pool = cuda_pool(pages=8)
    kernels = KernelConfig(gemv=GemvConfig(), small_gemm=SmallGemmConfig(),
                           fp8_scaled_mm_min_rows=None, fp8_small_gemm=True)  # fmt: skip
    graphed = model_engine("graphed", cfg, model, pool, graphs=True, kernels=kernels)
    eager = model_engine("eager", cfg, eager_model, pool, graphs=False)
    use_scaled_mm(eager_model, torch.device("cuda"), None)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    ops = graphed.runner.graphs.step_ops
    assert ops.fp8 and ops.fp8_small  # the FP8 kernels passed their checks here
    for n in (1, 3, 16):
        ps = prompts(n, seed=n)
        ref_tokens, ref_logits = greedy(eager, ps, 20)
        tokens, logits = greedy(graphed, ps, 20)
        same = assert_no_real_divergence(ref_tokens, ref_logits, tokens, tie=0.02)
        assert same >= n // 2, (same, n)
        assert_logits_close(ref_tokens, ref_logits, tokens, logits, 2e-2)
    for me in (graphed, eager):
        me.check_integrity()
        me.close()


def test_an_fp8_model_serves_with_graphs_and_half_the_weight_bytes():
    bf16 = ModelSpec("b", MODEL, max_model_len=1024, max_num_seqs=8, seed=3)
    fp8 = ModelSpec("f", MODEL, max_model_len=1024, max_num_seqs=8, seed=3, quantization="fp8")
    prompts = [[300 + (7 * i + j) % 500 for j in range(40 + 30 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(EngineConfig(models=(bf16, fp8), device="cuda")) as e:
        runner = e.worker.models["f"].runner
        assert runner.graphs is not None
        if scaled_mm_runs(torch.device("cuda")):  # its steps outside the GEMVs: _scaled_mm
            fp8_layers = [m for m in runner.model.modules() if isinstance(m, Fp8Linear)]
            assert fp8_layers and all(m.scaled_mm_min_rows == 1 for m in fp8_layers)
        sizes = {m: e.model_snapshot(m).weight_bytes for m in "bf"}
        assert sizes["f"] < 0.7 * sizes["b"], sizes
        first = e.generate("f", prompts, greedy)
        assert all(o.finish_reason is FinishReason.LENGTH for o in first)
        e.evict("f")
        e.activate("f")
        again = e.generate("f", prompts, greedy)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        e.check_integrity()
