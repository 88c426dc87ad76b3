"""Model loading: presets, ByteTokenizer, ModelSource, dummy/HF/GGUF loading, GGUF conversion."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

from models import gguf_convert
from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.embedded import EMBEDDED_MODELS, embedded_gguf_path, resolve_source
from models.gguf_convert import convert_gguf, gguf_state_dict
from models.gguf_tensors import GgufTensorMap, unpermute_rope
from models.loader import LoadedModel, ModelSource, init_dummy_weights, load_model
from models.presets import get_preset, list_presets
from models.registry import get_model_class
from models.safetensors_files import iter_safetensors, safetensors_files
from models.tokenizer import BYTE_OFFSET, MIN_VOCAB_SIZE, ByteTokenizer, load_tokenizer

# Published parameter counts (model cards / HF safetensors metadata).
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1.236e9,
    "llama-3.2-3b": 3.213e9,
    "llama-3.1-8b": 8.030e9,
    "mistral-7b": 7.248e9,
    "qwen2.5-7b": 7.616e9,
    "qwen2.5-14b": 14.770e9,
    "qwen3-8b": 8.191e9,
    "gemma-3-1b": 1.000e9,
}
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


def _meta_param_count(cfg: dict) -> int:
    config = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = get_model_class(config.hf_architecture)(config)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def _prefill_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Our model's logits [len(ids), vocab] for one sequence through the paged path."""
    cfg, bs = lm.config, 4
    blocks = -(-len(ids) // bs)
    caches = [
        torch.zeros(
            blocks + 1,
            2,
            bs,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=next(lm.model.parameters()).dtype,
        )
        for _ in range(cfg.num_layers)
    ]
    md = AttentionMetadata.build(
        [SeqChunk(0, len(ids), range(1, blocks + 1))], bs, torch.device("cpu")
    )
    hidden = lm.model(
        torch.tensor(ids),
        torch.arange(len(ids)),
        ForwardContext(attn=TorchPagedAttention(caches, md)),
    )
    return lm.model.compute_logits(hidden)


@torch.no_grad()
def _hf_logits(hf: tf.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def _tiny_hf_llama(tie: bool = False, seed: int = 0) -> tf.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    with torch.no_grad():  # norms away from 1 so a mix-up between them shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_shapes_give_the_published_parameter_count(name):
    ours = _meta_param_count(get_preset(name))
    assert ours == pytest.approx(PUBLISHED_PARAMS[name], rel=2e-3)
    cfg = get_preset(name)
    hf_cfg = tf.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(hf_cfg)
    assert ours == sum(p.numel() for p in hf.parameters())  # same tensors as transformers


def test_llama_8b_preset_fields():
    config = ModelConfig.from_hf(get_preset("llama-3.1-8b"))
    assert _meta_param_count(get_preset("llama-3.1-8b")) == pytest.approx(8.03e9, rel=1e-3)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        32,
        32,
        8,
        128,
    )
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.kv_bytes_per_token(torch.bfloat16) == 128 * 1024  # 128 KiB per token
    assert not config.tie_word_embeddings


def test_gemma3_1b_preset_has_sliding_layers_every_sixth_global():
    config = ModelConfig.from_hf(get_preset("gemma-3-1b"))
    assert config.sliding_window == 512
    assert [i for i, t in enumerate(config.layer_types) if t == "full"] == [5, 11, 17, 23]
    assert config.rope_local_theta == 10000.0 and config.rope_theta == 1e6
    assert config.attn_scale == 256**-0.5 and config.tie_word_embeddings


def test_unknown_preset_lists_the_presets_and_presets_are_copies():
    with pytest.raises(ValueError, match="llama-3.1-8b.*tiny-llama|tiny-llama"):
        get_preset("llama-9000")
    get_preset("tiny-llama")["hidden_size"] = 1
    assert get_preset("tiny-llama")["hidden_size"] == 64
    assert "tiny-llama" in list_presets()


# ---------------------------------------------------------------- ByteTokenizer


def test_byte_tokenizer_round_trips_utf8_one_token_per_byte():
    tok = ByteTokenizer(512)
    text = "naïve café — 東京 🚀\n\ttabs  and\x00nul"
    ids = tok(text).input_ids
    assert ids == [BYTE_OFFSET + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok("<|im_start|>x").input_ids == [
        tok.convert_tokens_to_ids("<|im_start|>"),
        BYTE_OFFSET + ord("x"),
    ]


def test_byte_tokenizer_decodes_every_id_of_a_large_vocab():
    tok = ByteTokenizer(152064)
    assert len(tok) == 152064
    text = tok.decode(list(range(MIN_VOCAB_SIZE, 152064)))
    assert text.startswith(f"<|id_{MIN_VOCAB_SIZE}|>") and text.endswith("<|id_152063|>")
    assert tok.decode([152063, 0, 1, 2, 3], skip_special_tokens=True) == "<|id_152063|>"
    assert all(isinstance(t, str) for t in tok.convert_ids_to_tokens(range(152064)))


def test_byte_tokenizer_chat_template_and_special_ids():
    tok = ByteTokenizer(300)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100)


def test_byte_tokenizer_saves_and_reloads(tmp_path):
    ByteTokenizer(400).save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok("héllo").input_ids == ByteTokenizer(400)("héllo").input_ids
    assert len(tok) == 400 and tok.chat_template
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        load_tokenizer(tmp_path / "nope")


# ---------------------------------------------------------------- ModelSource


def test_model_source_parse(tmp_path):
    assert ModelSource.parse("dummy:llama-3.1-8b") == ModelSource("dummy", "llama-3.1-8b")
    with pytest.raises(ValueError, match="tiny-llama"):
        ModelSource.parse("dummy:nope")
    assert ModelSource.parse(str(tmp_path)) == ModelSource("hf", str(tmp_path))
    gguf_file = tmp_path / "m.bin"  # recognized by content, not by suffix
    gguf_file.write_bytes(b"GGUF" + bytes(20))
    assert ModelSource.parse(str(gguf_file)) == ModelSource("gguf", str(gguf_file))
    assert ModelSource.parse(str(gguf_file)).name == "m"
    other = tmp_path / "weights.pt"
    other.write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="weights.pt"):
        ModelSource.parse(str(other))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ModelSource.parse(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError):
        ModelSource("onnx", "x")


def test_embedded_names_resolve_to_their_gguf_files():
    assert set(EMBEDDED_MODELS) == {"smollm2-135m", "gemma3-270m"}
    src = ModelSource.parse("smollm2-135m")
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_source("dummy:tiny-llama") == "dummy:tiny-llama"
    with pytest.raises(ValueError, match="smollm2-135m"):
        embedded_gguf_path("gpt-5")


# ---------------------------------------------------------------- dummy weights


def test_dummy_tiny_llama_loads_with_finite_logits():
    lm = load_model("dummy:tiny-llama")
    assert lm.name == "tiny-llama" and lm.config.num_layers == 2
    logits = _prefill_logits(lm, lm.tokenizer("hello wörld").input_ids)
    assert logits.shape == (len("hello wörld".encode()), 512)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert lm.config.eos_token_ids == (lm.tokenizer.eos_token_id,)
    norm = lm.model.model.norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert lm.model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_dummy_weights_are_deterministic_in_the_target_dtype():
    a = load_model("dummy:tiny-llama", dtype=torch.bfloat16, seed=1).model.state_dict()
    b = load_model("dummy:tiny-llama", dtype=torch.bfloat16, seed=1).model.state_dict()
    c = load_model("dummy:tiny-llama", dtype=torch.bfloat16, seed=2).model.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_dummy_gemma3_norms_are_zero_for_the_one_plus_w_convention():
    cfg = {
        **get_preset("gemma-3-1b"),
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "layer_types": None,
        "head_dim": 16,
    }
    config = ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = get_model_class(config.hf_architecture)(config)
    model.to_empty(device="cpu")
    init_dummy_weights(model, seed=0)
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert len(norms) == 2 * 6 + 1  # 4 sandwich + q/k norms per layer, final norm
    assert all(torch.equal(p, torch.zeros_like(p)) for p in norms.values())


# ---------------------------------------------------------------- HF directories


def _save_hf_dir(path: Path, hf: tf.PreTrainedModel, **save_kw) -> Path:
    hf.save_pretrained(path, **save_kw)
    ByteTokenizer(hf.config.vocab_size).save_pretrained(path)
    return path


@pytest.mark.parametrize("tie, shard", [(False, None), (True, "100KB")])
def test_hf_directory_loads_and_matches_transformers(tmp_path, tie, shard):
    hf = _tiny_hf_llama(tie=tie)
    kw = {"max_shard_size": shard} if shard else {}
    path = _save_hf_dir(tmp_path, hf, **kw)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    lm = load_model(ModelSource.parse(str(path)))
    assert (lm.model.lm_head.weight is lm.model.model.embed_tokens.weight) == tie
    torch.testing.assert_close(
        _prefill_logits(lm, PROMPT), _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4
    )
    assert lm.tokenizer.decode(lm.tokenizer("ok").input_ids) == "ok"


def test_hf_directory_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ModelSource("hf", str(tmp_path)))
    path = _save_hf_dir(tmp_path, _tiny_hf_llama())
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="config.json.*GPT2LMHeadModel"):
        load_model(ModelSource("hf", str(path)))
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ModelSource("hf", str(path)))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelSource("hf", str(path)))


# ---------------------------------------------------------------- GGUF

_HF_TO_GGUF_BLOCK = {  # written out independently of models.gguf_tensors
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_llama_gguf(path: Path, hf: tf.LlamaForCausalLM) -> Path:
    """A llama.cpp-style F32 GGUF of `hf`: renamed tensors, q/k permuted, a byte-level vocab."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    byte_chars = [
        ByteTokenizer(MIN_VOCAB_SIZE).convert_ids_to_tokens(BYTE_OFFSET + b) for b in range(256)
    ]
    tokens = ["<pad>", "<s>", "</s>", "<unk>", *byte_chars, "Ġt", "he"]
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_token_types([3, 3, 3, 2] + [1] * 258)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        a = t.numpy()
        if "q_proj" in name:
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif "k_proj" in name:
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        if name in _HF_TO_GGUF_TOP:
            gname = _HF_TO_GGUF_TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"
        w.add_tensor(gname, np.ascontiguousarray(a))  # torch layout; the writer reverses dims
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def cache_of(path) -> Path:
    """Where the tests cache the conversion of a GGUF file: beside it."""
    return Path(path).parent / "cache" / "gguf"


@pytest.fixture()
def tiny_gguf(tmp_path):
    hf = _tiny_hf_llama()
    return hf, write_tiny_llama_gguf(tmp_path / "tiny.gguf", hf)


def test_rope_unpermute_inverts_llama_cpp():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rope(_llama_cpp_permute(w, 8), 8), w)


def test_gguf_tensors_map_to_the_same_hf_tensors(tiny_gguf):
    hf, path = tiny_gguf
    ours = dict(gguf_state_dict(path))
    ref = hf.state_dict()
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], t), name


def test_gguf_converts_to_a_cached_hf_dir_that_loads(tiny_gguf, tmp_path):
    hf, path = tiny_gguf
    out = convert_gguf(path, cache_of(path))
    assert out.parent == tmp_path / "cache" / "gguf" and out.name.startswith("tiny-")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    converted = dict(iter_safetensors(safetensors_files(out)))
    assert all(torch.equal(converted[k], v) for k, v in hf.state_dict().items())
    lm = load_model(str(path), cache_root=cache_of(path))
    assert lm.name == "tiny"
    torch.testing.assert_close(
        _prefill_logits(lm, PROMPT), _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4
    )
    assert lm.tokenizer.decode(lm.tokenizer("the héllo").input_ids) == "the héllo"


def test_big_gguf_conversions_are_sharded(tiny_gguf, monkeypatch):
    hf, path = tiny_gguf
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 << 10)
    out = convert_gguf(path, cache_of(path))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = safetensors_files(out)
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(hf.state_dict())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in hf.state_dict().values())
    lm = load_model(str(path), cache_root=cache_of(path))
    torch.testing.assert_close(
        _prefill_logits(lm, PROMPT), _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4
    )


def test_gguf_conversion_is_cached_and_an_interrupted_one_is_not_reused(tiny_gguf, monkeypatch):
    _, path = tiny_gguf
    real_write = gguf_convert._write_weights

    def interrupted(reader, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, cache_of(path))
    cache = gguf_convert.gguf_cache_dir(path, cache_of(path))
    assert not cache.exists() and list(cache.parent.iterdir()) == []  # no temp dir left
    monkeypatch.setattr(gguf_convert, "_write_weights", real_write)
    out = convert_gguf(path, cache_of(path))
    assert out == cache and safetensors_files(out)
    monkeypatch.setattr(gguf_convert, "_write_weights", interrupted)
    assert convert_gguf(path, cache_of(path)) == out  # cached: not converted again
    path.touch()  # a changed file (new mtime) gets a new cache entry
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, cache_of(path))


def test_gguf_name_mapping_for_gemma3_and_errors():
    tmap = GgufTensorMap("gemma3", num_heads=4, num_kv_heads=1)
    assert tmap.hf_name("blk.3.post_attention_norm.weight") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    assert tmap.hf_name("blk.3.ffn_norm.weight") == (
        "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert tmap.hf_name("blk.0.post_ffw_norm.weight") == (
        "model.layers.0.post_feedforward_layernorm.weight"
    )
    assert tmap.hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert tmap.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    ones = np.ones(8, dtype=np.float32)
    assert np.array_equal(tmap.to_hf("blk.0.attn_q_norm.weight", ones), np.zeros(8))
    assert np.array_equal(tmap.to_hf("blk.0.attn_q.weight", ones), ones)  # no permute
    llama = GgufTensorMap("llama", 4, 2)
    assert llama.hf_name("blk.1.ffn_norm.weight") == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    assert llama.hf_name("rope_freqs.weight") is None
    with pytest.raises(KeyError, match="ssm_conv1d"):
        llama.hf_name("blk.0.ssm_conv1d.weight")
    with pytest.raises(ValueError, match="mamba"):
        GgufTensorMap("mamba", 1, 1)


def test_corrupt_gguf_error_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad), cache_root=cache_of(bad))


@pytest.mark.slow
def test_embedded_smollm2_converts_like_transformers(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_gguf_path("smollm2-135m")
    out = convert_gguf(path, cache_root=tmp_path)
    ours = dict(iter_safetensors(safetensors_files(out)))
    hf_cfg = tf.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        meta = tf.AutoModelForCausalLM.from_config(hf_cfg)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t.float()), name
    tok = load_tokenizer(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert ModelConfig.from_hf(hf_cfg).tie_word_embeddings


@pytest.mark.slow
def test_the_embedded_gemmas_control_and_image_markers_are_special():
    """The GGUF's control tokens and Gemma's image markers are special after conversion, so
    skip_special_tokens keeps them out of text; the vocabulary and plain tokens are unchanged."""
    from models.loader import model_dir
    from models.tokenizer import load_tokenizer
    from prism_server import envs

    tok = load_tokenizer(model_dir(ModelSource.parse("gemma3-270m"), envs.gguf_cache_dir()))
    assert len(tok) == 262144
    image, turn, table = tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_turn>", "<table>"])
    text = tok.decode([image, 2000, turn, table], skip_special_tokens=True)
    assert "<start_of_image>" not in text and "<end_of_turn>" not in text and "<table>" in text
    assert tok.decode([image], skip_special_tokens=False) == "<start_of_image>"
    assert tok("<start_of_turn>user").input_ids[1] == tok.convert_tokens_to_ids("<start_of_turn>")
