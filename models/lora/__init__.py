"""LoRA adapters of a base model: read from the PEFT format, placed like a model's weights, and
applied to a step's tokens by adapter slot (a step mixes several adapters and the base).

    adapter = read_adapter("/adapters/sql", base)          # validated against the base
    weights = adapter.place(place)                         # views into its pooled buffer
    slots = LoraSlots(base, num_slots=8)
    slots.assign(0, weights)
    ctx = ForwardContext(attn=..., lora=slots.batch([0, 0, NO_ADAPTER, 0], device))
"""

from models.lora.adapter import DEFAULT_MAX_RANK, SUPPORTED_TARGETS, AdapterError, read_adapter
from models.lora.batch import NO_ADAPTER, LoraBatch, LoraSlots
from models.lora.weights import LoraAdapter, LoraModule, LoraShard, LoraWeights, lora_targets

__all__ = [
    "DEFAULT_MAX_RANK",
    "NO_ADAPTER",
    "SUPPORTED_TARGETS",
    "AdapterError",
    "LoraAdapter",
    "LoraBatch",
    "LoraModule",
    "LoraShard",
    "LoraSlots",
    "LoraWeights",
    "lora_targets",
    "read_adapter",
]
