"""Maps a HF architecture string (config.json `architectures[0]`) to our model class."""

from __future__ import annotations

from models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from models.layers.causal_lm import CausalLM
from models.llama import LlamaForCausalLM, MistralForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # text part only
}


def get_model_class(hf_arch: str) -> type[CausalLM]:
    try:
        return MODEL_CLASSES[hf_arch]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {hf_arch!r}; supported: {', '.join(sorted(MODEL_CLASSES))}"
        ) from None
