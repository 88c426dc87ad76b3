"""How one GGUF tensor becomes one HF tensor: its HF parameter name and llama.cpp's layout fixes.

llama.cpp's convert_hf_to_gguf.py renames every tensor (`blk.N.attn_q.weight`), permutes the
rows of Llama q/k projections for its interleaved rope, and stores Gemma norms as (1 + w). This
module undoes all three, for the GGUF architectures Prism's models cover. Shapes need no fix:
a GGUF shape field lists dims innermost first, so the numpy array `gguf` returns is already
torch's [out_features, in_features].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# GGUF `general.architecture` -> HF architecture (Mistral GGUFs say "llama").
GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# HF model_type (as transformers reads it from a GGUF) -> HF architecture.
MODEL_TYPE_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {  # suffix inside blk.N -> suffix inside model.layers.N
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK = {  # Gemma 3 norms around both sublayers ("sandwich" norms)
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp adds that HF recomputes from the config (llama3 rope frequencies).
_DERIVED = {"rope_freqs"}
_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias)")


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute).

    llama.cpp reorders each head's rows from HF's [half 0 | half 1] rotary layout to interleaved
    pairs; this restores the halves. w: [n_head * head_dim, ...] -> same shape.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GgufTensorMap:
    """Names and layout fixes for the tensors of one GGUF file."""

    arch: str  # GGUF general.architecture
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        if self.arch not in GGUF_ARCHS:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(sorted(GGUF_ARCHS))}"
            )

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name of a GGUF tensor; None for tensors HF derives from the config."""
        m = _NAME.fullmatch(gguf_name)
        if m is None:
            raise KeyError(f"unexpected GGUF tensor name {gguf_name!r}")
        base, kind = m["base"], m["kind"]
        if m["layer"] is None:
            if base in _DERIVED:
                return None
            if base in _TOP_LEVEL:
                return f"{_TOP_LEVEL[base]}.{kind}"
        else:
            block = _GEMMA3_BLOCK if self.arch == "gemma3" else _BLOCK
            if base in block:
                return f"model.layers.{m['layer']}.{block[base]}.{kind}"
        raise KeyError(f"GGUF tensor {gguf_name!r} has no HF counterpart for arch {self.arch!r}")

    def to_hf(self, gguf_name: str, data: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's layout changes on a dequantized tensor (float32, torch layout)."""
        if self.arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rope(data, self.num_heads)
        if self.arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rope(data, self.num_kv_heads)
        if self.arch == "gemma3" and gguf_name.endswith("norm.weight"):
            return data - 1.0  # GGUF stores Gemma's (1 + w); HF keeps w
        return data
