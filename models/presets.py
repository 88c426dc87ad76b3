"""Named model shapes for dummy-weight models: the published HF config.json of each model.

Dummy models (`dummy:<preset>`) get random weights with these exact shapes, so GPU benchmarks see
the real memory footprint and FLOPs without a hub. Values follow the models' config.json files
(the fields a serving engine reads; training-only fields left out).
"""

from __future__ import annotations

import copy
from typing import Any

_LLAMA3_ROPE_8B = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_3_2 = {**_LLAMA3_ROPE_8B, "factor": 32.0}


def _llama(**kw: Any) -> dict[str, Any]:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    return {**base, **kw}


def _qwen2(**kw: Any) -> dict[str, Any]:
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return {**base, **kw}


def _gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    # every `pattern`-th layer attends globally, the others through the sliding window
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_3_2,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.2-3b": _llama(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_3_2,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-8b": _llama(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_8B,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-70b": _llama(  # two H200s' worth (141 GB of bf16 weights): tensor parallel
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_8B,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "mistral-7b": {  # Mistral-7B-v0.3: 32768 vocab, rope 1e6, no sliding window
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": _qwen2(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        sliding_window=131072,
        max_window_layers=28,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-14b": _qwen2(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        sliding_window=131072,
        max_window_layers=48,
        rms_norm_eps=1e-5,
    ),
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "layer_types": _gemma3_layer_types(26, 6),
        "rms_norm_eps": 1e-6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    # Test-sized Llama: 2 layers, hidden 64, GQA 4:2; vocab fits the ByteTokenizer.
    "tiny-llama": _llama(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    ),
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of preset `name`'s HF config dict."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(list_presets())}")
    return copy.deepcopy(PRESETS[name])
