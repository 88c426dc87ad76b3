"""ModelConfig: one model's architecture, normalized from a HF config.

`ModelConfig.from_hf()` is the only place that knows HF config quirks: transformers 4 vs 5 shapes
(`rope_theta`/`rope_scaling` vs `rope_parameters`, per-layer-type rope for Gemma3), Qwen2's
`use_sliding_window`, Mistral's all-layers sliding window, Gemma3 multimodal configs nesting the
text model under `text_config`. Everything downstream reads plain, validated fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# HF architecture string -> our family key.
ARCH_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
# HF model_type -> HF architecture, for configs without `architectures` (e.g. built in code).
_MODEL_TYPE_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}
_DEFAULT_THETA = {"llama": 10_000.0, "qwen2": 10_000.0, "qwen3": 10_000.0, "gemma3": 1_000_000.0}
_GEMMA3_LOCAL_THETA = 10_000.0
_ROPE_SCALINGS = ("linear", "llama3")
_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only model. Build with `ModelConfig.from_hf(cfg)`."""

    architecture: str  # family key: "llama" | "qwen2" | "qwen3" | "gemma3"
    hf_architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # rope base of full-attention layers (all layers unless gemma3)
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3", ...}; None = plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm on q and k before rope
    hidden_act: str  # "silu" | "gelu_pytorch_tanh"
    sliding_window: int | None  # positions a sliding layer attends to, query included
    layer_types: tuple[str, ...]  # "full" | "sliding", one per layer
    rope_local_theta: float | None  # gemma3 sliding layers' rope base (plain rope), else None
    query_pre_attn_scalar: float | None  # attention scale is its -1/2 power when set
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # checkpoint dtype, e.g. "bfloat16"
    attention_out_bias: bool = False  # bias on o_proj (Qwen2 has qkv bias but none here)
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in _DEFAULT_THETA:
            raise ValueError(f"unknown architecture family {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        if set(self.layer_types) - {"full", "sliding"}:
            raise ValueError(f"layer_types must be 'full' or 'sliding': {set(self.layer_types)}")
        if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding layers need a positive sliding_window")
        if (
            self.rope_scaling is not None
            and self.rope_scaling.get("rope_type") not in _ROPE_SCALINGS
        ):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling}; have {_ROPE_SCALINGS}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; have {_ACTS}")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)

    @property
    def attn_scale(self) -> float:
        """Softmax scale applied to q.k."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one token occupies across all layers."""
        itemsize = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @staticmethod
    def from_hf(cfg: Any) -> ModelConfig:
        """cfg: a transformers PretrainedConfig or the dict of a config.json."""
        d = _as_v5_dict(cfg)
        hf_arch = (d.get("architectures") or [None])[0] or _MODEL_TYPE_ARCH.get(d.get("model_type"))
        if isinstance(d.get("text_config"), dict):  # multimodal wrapper: serve the text model
            outer, d = d, dict(d["text_config"])
            for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
                if outer.get(key) is not None:
                    d[key] = outer[key]
        if hf_arch not in ARCH_FAMILIES:
            raise ValueError(f"unsupported architecture {hf_arch!r}; have {sorted(ARCH_FAMILIES)}")
        family = ARCH_FAMILIES[hf_arch]
        gemma = family == "gemma3"
        full_rope, local_rope = _rope_params(d)
        if d.get("use_bidirectional_attention"):
            raise ValueError("bidirectional (embedding) Gemma3 variants are not supported")
        if local_rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported sliding-layer rope {local_rope}")
        num_layers = d["num_hidden_layers"]
        num_heads = d["num_attention_heads"]
        sliding_window, layer_types = _sliding_layers(d, hf_arch, num_layers)
        eos = d.get("eos_token_id")
        bias = bool(d.get("attention_bias", False))
        act = (d.get("hidden_activation") if gemma else None) or d.get("hidden_act", "silu")
        local_theta = float(local_rope.get("rope_theta") or _GEMMA3_LOCAL_THETA)
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32")
        return ModelConfig(
            architecture=family,
            hf_architecture=hf_arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full_rope.get("rope_theta") or _DEFAULT_THETA[family]),
            rope_scaling=_rope_scaling(full_rope, d),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            # NOTE: Qwen2 hardcodes bias on q/k/v (not o_proj) and has no attention_bias key.
            attention_bias=True if family == "qwen2" else bias,
            attention_out_bias=False if family == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3"),
            hidden_act=act,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_theta=local_theta if gemma else None,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256) if gemma else None,
            final_logit_softcapping=d.get("final_logit_softcapping"),
            # NOTE: HF's Gemma3 attention ignores attn_logit_softcapping; match it.
            attn_logit_softcapping=None if gemma else d.get("attn_logit_softcapping"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            torch_dtype=dtype.removeprefix("torch."),
        )


def _as_v5_dict(cfg: Any) -> dict:
    """Plain dict, with transformers' class defaults and v5 normalization applied when it can."""
    if not isinstance(cfg, dict):
        return cfg.to_dict()
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(**cfg).to_dict()
    except (KeyError, ValueError, TypeError):  # unknown model_type: parse the raw dict
        return dict(cfg)


def _rope_params(d: dict) -> tuple[dict, dict]:
    """(full-attention rope params, sliding-attention rope params), v5 shape, from either shape."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "full_attention" in params or "sliding_attention" in params:  # per layer type (gemma3)
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params), {}
    full = {"rope_theta": d.get("rope_theta"), **{k: v for k, v in full.items() if v is not None}}
    local.setdefault("rope_theta", d.get("rope_local_base_freq"))
    return full, local


def _rope_scaling(params: dict, d: dict) -> dict | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return scaling


def _sliding_layers(d: dict, hf_arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    window = d.get("sliding_window")
    if hf_arch.startswith("Qwen") and not d.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window they do not use
    if hf_arch == "MistralForCausalLM":  # one window for every layer (None in Mistral v0.2+)
        return window, ("sliding" if window else "full",) * num_layers
    if d.get("layer_types"):
        types = tuple("sliding" if t == "sliding_attention" else t for t in d["layer_types"])
        types = tuple("full" if t == "full_attention" else t for t in types)
        return (window if "sliding" in types else None), types
    if hf_arch.startswith("Gemma3"):  # transformers 4 shape: every Nth layer is global
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
        return window, types
    if window is not None and hf_arch.startswith("Qwen"):
        first = d.get("max_window_layers", num_layers)
        return window, tuple("sliding" if i >= first else "full" for i in range(num_layers))
    return None, ("full",) * num_layers
