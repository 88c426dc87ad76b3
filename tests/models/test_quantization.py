"""FP8 weights: the quantizer's error bound, Fp8Linear, FP8 dummy models, and checkpoints that
already hold FP8 weights (vLLM's `fp8` and the `compressed-tensors` layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from safetensors.torch import load_file, save_file

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.layers.causal_lm import weight_bytes
from models.layers.fp8_linear import FP8_DTYPE, Fp8Linear, fp8_linear
from models.layers.merged_linear import MergedLinear
from models.loader import LoadedModel, load_model, meta_model
from models.presets import get_preset
from models.quantization import (
    checkpoint_block,
    checkpoint_fp8,
    dequantize_fp8,
    expand_scale,
    quantize_fp8,
    requantize_blocks,
)
from models.tokenizer import ByteTokenizer

# E4M3: 3 mantissa bits, so a value in the normal range (|v| >= 2**-6 of the scale's unit)
# rounds within 2**-4 of itself; below it (subnormals, steps of 2**-9) within 2**-10 absolute.
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = dict(
    vocab_size=262,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT = [5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 1, 180]
BLOCK = (16, 48)  # the block-wise checkpoints' scale blocks: ragged over TINY's 64 columns


def _block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] in FP8 with a scale a block (as a block-wise checkpoint holds it): (q [N, K],
    scale [ceil(N / rows), ceil(K / cols)])."""
    (n, k), (rows, cols) = w.shape, block
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    scale = torch.empty(-(-n // rows), -(-k // cols))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            s = part.abs().amax().clamp(min=1e-12) / 448.0
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (part / s).to(FP8_DTYPE)
            scale[i, j] = s
    return q, scale


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    (n, k), (rows, cols) = q.shape, block
    full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return q.float() * full


def _check_round_trip(w: torch.Tensor) -> tuple[float, float]:
    """Asserts the per-element bound of w's FP8 round trip; (median, worst) per-row relative
    error ||w - w'|| / ||w|| over the rows."""
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    back = dequantize_fp8(q, scale, torch.float32)
    err = (back - w).abs()
    bound = torch.maximum(REL_BOUND * w.abs(), SUBNORMAL_ABS * scale[:, None])
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound).max())
    # the row's largest magnitude is E4M3's largest, 448: represented exactly
    torch.testing.assert_close(back.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)
    rel = (back - w).norm(dim=1) / w.norm(dim=1)
    return float(rel.median()), float(rel.max())


def test_round_trip_of_random_weights_is_within_e4m3s_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * 0.02
    median, worst = _check_round_trip(w)
    assert median < 0.03 and worst < 0.035  # measured 0.026 and 0.028


def test_round_trip_of_outlier_heavy_weights_stays_per_channel():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 1024, generator=g) * 0.02
    w[:, ::97] *= 200.0  # a few huge columns in every row (up to ~15x the bulk's amax)
    w[7] *= 1e4  # one row far larger than the rest: its own scale, the others unaffected
    torch.manual_seed(0)
    w[8] = torch.distributions.StudentT(2.0).sample((1024,)) * 0.01  # a heavy-tailed row
    median, worst = _check_round_trip(w)
    assert median < 0.025 and worst < 0.04  # measured 0.020 and 0.034
    q, scale = quantize_fp8(w)
    assert scale[7] / scale[6] > 1e3  # per row: row 7's range does not flatten row 6's
    # the ordinary values beside the outliers stay in E4M3's normal range: 2.7% (measured)
    quiet = torch.arange(1024) % 97 != 0
    back = dequantize_fp8(q, scale, torch.float32)[:, quiet]
    rel = (back - w[:, quiet]).norm(dim=1) / w[:, quiet].norm(dim=1)
    assert rel.max() < 0.035


def test_zero_rows_bf16_input_and_bad_shapes():
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    w[1, 3] = 2.0
    q, scale = quantize_fp8(w)
    assert scale.tolist() == torch.tensor([1.0, 2.0 / 448, 1.0, 1.0]).tolist()  # float32
    assert dequantize_fp8(q, scale, torch.bfloat16).equal(w)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8(torch.zeros(8))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8(torch.zeros(2, 8, dtype=torch.int32))


def test_checkpoint_scales_expand_to_one_per_row():
    assert expand_scale(torch.tensor(0.5), 3, "w").tolist() == [0.5] * 3
    assert expand_scale(torch.tensor([0.5]), 3, "w").tolist() == [0.5] * 3
    assert expand_scale(torch.tensor([[1.0], [2.0], [3.0]]), 3, "w").tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="block-wise"):
        expand_scale(torch.ones(3, 2), 3, "layer.weight_scale")
    with pytest.raises(ValueError, match="per-output-channel of 4 rows"):
        expand_scale(torch.ones(3), 4, "w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_dequantized_linear(dtype):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    x = torch.randn(5, 32, generator=g).to(dtype)
    q, scale = quantize_fp8(w)
    got = fp8_linear(x, q, scale, b.to(dtype))
    ref = F.linear(x.float(), dequantize_fp8(q, scale, torch.float32), b)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


# ---------------------------------------------------------------- FP8 models built by Prism


def test_dummy_fp8_model_is_its_bf16_twin_quantized():
    twin = load_model("dummy:tiny-llama", dtype=torch.bfloat16, seed=3).model
    fp8 = load_model("dummy:tiny-llama", dtype=torch.bfloat16, seed=3, quantization="fp8").model
    mods = dict(twin.named_modules())
    projected = 0
    for name, m in fp8.named_modules():
        if isinstance(m, Fp8Linear):
            q, scale = quantize_fp8(mods[name].weight)
            assert m.weight.view(torch.uint8).equal(q.view(torch.uint8)), name
            assert m.weight_scale.equal(scale), name
            projected += m.weight.numel()
            assert m.shards == getattr(mods[name], "shards", None)
    assert projected > 0
    # embeddings, norms and the LM head: the twin's, in bf16
    assert fp8.model.embed_tokens.weight.equal(twin.model.embed_tokens.weight)
    assert fp8.lm_head.weight.equal(twin.lm_head.weight)
    assert fp8.lm_head.weight.dtype == torch.bfloat16
    # bytes: each projection weight 1 byte instead of 2, plus a float32 scale a row
    rows = sum(m.out_features for m in fp8.modules() if isinstance(m, Fp8Linear))
    assert weight_bytes(fp8) == weight_bytes(twin) - projected + 4 * rows


def test_an_8b_shape_in_fp8_is_about_half_its_bf16_bytes():
    cfg = ModelConfig.from_hf(get_preset("llama-3.1-8b"))
    bf16 = weight_bytes(meta_model(cfg, torch.bfloat16))
    fp8 = weight_bytes(meta_model(cfg, torch.bfloat16, "fp8"))
    assert bf16 == pytest.approx(16.06e9, rel=1e-3)
    # 6.98e9 projection weights at 1 byte; the 2.1 GB of embeddings and LM head stay bf16:
    # 9.09 GB, 0.566 of bf16
    assert fp8 == pytest.approx(9.087e9, rel=1e-3)
    assert 0.56 < fp8 / bf16 < 0.57


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of 'fp8'"):
        load_model("dummy:tiny-llama", quantization="int4")


# ---------------------------------------------------------------- FP8 checkpoints


def _paged_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), vocab] for one sequence through the paged path."""
    cfg, bs = lm.config, 4
    blocks = -(-len(ids) // bs)
    dtype = lm.model.model.embed_tokens.weight.dtype
    caches = [
        torch.zeros(blocks + 1, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        for _ in range(cfg.num_layers)
    ]
    md = AttentionMetadata.build(
        [SeqChunk(0, len(ids), range(1, blocks + 1))], bs, torch.device("cpu")
    )
    with torch.no_grad():
        ctx = ForwardContext(attn=TorchPagedAttention(caches, md))
        hidden = lm.model(torch.tensor(ids), torch.arange(len(ids)), ctx)
        return lm.model.compute_logits(hidden)


def _tiny_hf_dir(path: Path, bias: bool = False) -> Path:
    """A tiny Llama (fp32 safetensors, ByteTokenizer) with weights of a realistic spread."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=bias)
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    hf.save_pretrained(path)
    ByteTokenizer(TINY["vocab_size"]).save_pretrained(path)
    return path


def _fp8_checkpoint(src: Path, dst: Path, method: str, per: str) -> Path:
    """src's checkpoint with every projection weight in FP8 E4M3 plus its `weight_scale` (per
    tensor or per channel) and a static `input_scale`, in `dst`, config.json saying so; and,
    beside it in dst/"reference", the same weights dequantized (a plain checkpoint)."""
    dst.mkdir()
    ref = dst / "reference"
    ref.mkdir()
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        layer = name.rsplit(".", 2)[-2]
        if not (name.endswith(".weight") and layer in PROJECTIONS):
            quantized[name] = dequantized[name] = w
            continue
        prefix = name.removesuffix(".weight")
        scale_name = f"{prefix}.weight_scale"
        if per == "block":  # a scale a block of BLOCK (vLLM's name for it: weight_scale_inv)
            q, stored = _block_quantize(w, BLOCK)
            scale_name += "_inv" if method == "fp8" else ""
            dequantized[name] = _block_dequantize(q, stored, BLOCK)
        elif per == "tensor":  # one scale for the tensor
            scale = w.abs().amax() / 448.0
            q = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
            stored = scale.reshape(()) if method == "fp8" else scale.reshape(1)
        else:
            q, scale = quantize_fp8(w)
            stored = scale[:, None]  # [N, 1]
        quantized[name] = q
        quantized[scale_name] = stored.float()
        quantized[f"{prefix}.input_scale"] = torch.tensor(0.02)  # unused: per-token at run time
        if per != "block":
            dequantized[name] = (q.float() * stored.float().reshape(-1, 1)).contiguous()
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, ref / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    json.dump(config, (ref / "config.json").open("w"))
    if method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
        if per == "block":
            config["quantization_config"]["weight_block_size"] = list(BLOCK)
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": per,
                                "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                          "symmetric": True, "dynamic": False},
                }
            },
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }  # fmt: skip
        if per == "block":
            group = config["quantization_config"]["config_groups"]["group_0"]["weights"]
            group["block_structure"] = list(BLOCK)
    json.dump(config, (dst / "config.json").open("w"))
    for d in (dst, ref):
        ByteTokenizer(TINY["vocab_size"]).save_pretrained(d)
    return dst


@pytest.mark.parametrize(
    "method, per, bias",
    [("fp8", "tensor", False), ("fp8", "channel", True), ("compressed-tensors", "tensor", True),
     ("compressed-tensors", "channel", False)],
)  # fmt: skip
def test_fp8_checkpoints_load_as_they_are(tmp_path, method, per, bias):
    src = _tiny_hf_dir(tmp_path / "src", bias=bias)
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", method, per)
    assert checkpoint_fp8(json.loads((ckpt / "config.json").read_text()))
    lm = load_model(str(ckpt), quantization="fp8")
    # the bytes are the checkpoint's: FP8 weights as stored, scales one per row
    stored = load_file(ckpt / "model.safetensors")
    qkv = lm.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8_DTYPE
    k_rows = qkv.shard_rows("k_proj")
    k = stored["model.layers.1.self_attn.k_proj.weight"]
    assert qkv.weight[k_rows].view(torch.uint8).equal(k.view(torch.uint8))
    k_scale = stored["model.layers.1.self_attn.k_proj.weight_scale"].reshape(-1)
    assert qkv.weight_scale[k_rows].equal(k_scale.expand(k_rows.stop - k_rows.start))
    if per == "tensor":  # q, k and v: each its own scale, repeated over its rows
        assert qkv.weight_scale.unique().numel() == 3
    ref = load_model(str(ckpt / "reference"))  # float32, the dequantized weights
    torch.testing.assert_close(
        _paged_logits(lm, PROMPT), _paged_logits(ref, PROMPT), rtol=1e-4, atol=1e-4
    )


def test_requantizing_blocks_by_row_adds_at_most_one_rounding():
    """A weight whose rows span 2**-6 .. 2**2 in size, with a column block 8 times larger in
    each (and ragged edge blocks): its values requantized by row are within E4M3's bound of
    the block-wise ones (one more rounding)."""
    torch.manual_seed(0)
    w = torch.randn(40, 100) * torch.logspace(-3, 1, 40, base=4.0)[:, None]
    w[:, 48:96] *= 8.0  # a column block of larger values in every row
    q, scale = _block_quantize(w, BLOCK)
    exact = _block_dequantize(q, scale, BLOCK)
    q2, row_scale = requantize_blocks(q, scale, BLOCK)
    assert q2.dtype == FP8_DTYPE and row_scale.shape == (40,)
    back = dequantize_fp8(q2, row_scale, torch.float32)
    bound = torch.maximum(REL_BOUND * exact.abs(), SUBNORMAL_ABS * row_scale[:, None])
    assert ((back - exact).abs() <= bound * (1 + 1e-6)).all()
    # the row's largest magnitude lands on 448, as quantize_fp8 puts it
    torch.testing.assert_close(back.abs().amax(1), exact.abs().amax(1), rtol=1e-6, atol=0)
    wrong = r"x.weight_scale_inv: block scales of shape \(3, 2\), want \(3, 3\)"
    with pytest.raises(ValueError, match=wrong):
        requantize_blocks(q, scale[:, :2], BLOCK, "x.weight_scale_inv")


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_block_wise_fp8_checkpoints_load_requantized_by_row(tmp_path, method):
    src = _tiny_hf_dir(tmp_path / "src", bias=method == "fp8")
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", method, "block")
    config = json.loads((ckpt / "config.json").read_text())
    assert checkpoint_fp8(config) and checkpoint_block(config) == BLOCK
    lm = load_model(str(ckpt), quantization="fp8")
    stored = load_file(ckpt / "model.safetensors")
    suffix = "_inv" if method == "fp8" else ""
    down = lm.model.model.layers[1].mlp.down_proj
    q, s = requantize_blocks(
        stored["model.layers.1.mlp.down_proj.weight"],
        stored[f"model.layers.1.mlp.down_proj.weight_scale{suffix}"],
        BLOCK,
    )
    assert down.weight.view(torch.uint8).equal(q.view(torch.uint8))
    assert down.weight_scale.equal(s)
    ref = load_model(str(ckpt / "reference"))  # float32: the block-wise values dequantized
    got, want = _paged_logits(lm, PROMPT), _paged_logits(ref, PROMPT)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_bad_block_wise_checkpoints_are_refused_naming_the_tensor(tmp_path):
    src = _tiny_hf_dir(tmp_path / "src")
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", "fp8", "block")
    scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    _edit(ckpt, tensors=lambda t: t.update({scale: t[scale][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=f"{scale}: block scales of shape \\(2, 1\\), want"):
        load_model(str(ckpt), quantization="fp8")
    _edit(ckpt, tensors=lambda t: t.pop(scale))
    with pytest.raises(ValueError, match="k_proj.weight: an FP8 weight with no block scales"):
        load_model(str(ckpt), quantization="fp8")


def test_a_plain_checkpoint_quantizes_at_load_to_what_prism_quantizes(tmp_path):
    src = _tiny_hf_dir(tmp_path / "src", bias=True)
    lm = load_model(str(src), quantization="fp8")
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", "compressed-tensors", "channel")
    pre = load_model(str(ckpt), quantization="fp8")
    for (name, a), (_, b) in zip(lm.model.named_parameters(), pre.model.named_parameters()):
        assert a.dtype == b.dtype and a.view(torch.uint8).equal(b.view(torch.uint8)), name
    plain = load_model(str(src))
    got, want = _paged_logits(lm, PROMPT), _paged_logits(plain, PROMPT)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def _edit(ckpt: Path, config=None, tensors=None) -> None:
    if config is not None:
        c = json.loads((ckpt / "config.json").read_text())
        config(c)
        (ckpt / "config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = load_file(ckpt / "model.safetensors")
        tensors(t)
        save_file(t, ckpt / "model.safetensors")


def test_bad_fp8_checkpoints_are_refused_with_the_reason(tmp_path):
    src = _tiny_hf_dir(tmp_path / "src")
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", "fp8", "tensor")
    with pytest.raises(ValueError, match="holds FP8 weights.*quantization = 'fp8'"):
        load_model(str(ckpt))  # not asked for FP8: never read as bf16 values

    def method(name):
        return lambda c: c["quantization_config"].update(quant_method=name)

    _edit(ckpt, config=method("awq"))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        load_model(str(ckpt), quantization="fp8")
    _edit(ckpt, config=lambda c: c["quantization_config"].update(
        quant_method="fp8", weight_block_size=[128, 128]))  # fmt: skip
    with pytest.raises(ValueError, match="an FP8 weight with no block scales"):
        load_model(str(ckpt), quantization="fp8")  # its scales are one a tensor
    _edit(ckpt, config=lambda c: c["quantization_config"].update(weight_block_size=[128]))
    with pytest.raises(ValueError, match=r"FP8 weight blocks \[128\] are not \[rows, cols\]"):
        load_model(str(ckpt), quantization="fp8")

    ct = _fp8_checkpoint(src, tmp_path / "ct", "compressed-tensors", "channel")
    _edit(ct, config=lambda c: c["quantization_config"]["config_groups"]["group_0"][
        "weights"].update(type="int", strategy="group"))  # fmt: skip
    with pytest.raises(ValueError, match="weights of type 'int', 8 bits, strategy 'group'"):
        load_model(str(ct), quantization="fp8")

    scale = "model.layers.0.mlp.down_proj.weight_scale"
    ct2 = _fp8_checkpoint(src, tmp_path / "ct2", "compressed-tensors", "channel")
    _edit(ct2, tensors=lambda t: t.update({scale: torch.ones(32, 48)}))
    with pytest.raises(ValueError, match="down_proj.weight_scale.*block-wise"):
        load_model(str(ct2), quantization="fp8")
    _edit(ct2, tensors=lambda t: t.pop(scale))
    with pytest.raises(ValueError, match=f"missing from the checkpoint.*{scale}"):
        load_model(str(ct2), quantization="fp8")
    _edit(ct2, tensors=lambda t: t.update(
        {"lm_head.weight": t["lm_head.weight"].to(FP8_DTYPE)}))  # fmt: skip
    with pytest.raises(ValueError, match="lm_head.weight.*must not be FP8"):
        load_model(str(ct2), quantization="fp8")


def test_merged_linear_and_fp8_linear_share_their_rows():
    lin = MergedLinear(8, {"a": 3, "b": 5}, bias=True)
    f = Fp8Linear.like(lin)
    assert f.shards == lin.shards and f.shard_rows("b") == lin.shard_rows("b") == slice(3, 8)
    assert f.bias is not None and f.bias.dtype == lin.weight.dtype
    with pytest.raises(ValueError, match="do not add up"):
        Fp8Linear(8, 9, False, torch.float32, {"a": 3})
