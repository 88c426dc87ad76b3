"""LoRA adapters of a base model: read from the PEFT format, placed like a model's weights, and
applied to a step's tokens by adapter slot (a step mixes several adapters and the base).

    adapter = read_adapter("/adapters/sql", base)          # validated against the base
    weights = adapter.place(place)                         # views into its pooled buffer
    slots = LoraSlots(base, num_slots=8)
    slots.assign(0, weights)
    ctx = ForwardContext(attn=..., lora=slots.batch([0, 0, NO_ADAPTER, 0], device))

On a GPU the step's deltas run as Triton kernels over every slot at once (KernelLoraBatch), and
decode graphs take them over a static input (LoraSlots.graph_input); on the CPU as torch GEMMs
per slot (TorchLoraBatch).
"""

from models.lora.adapter import (
    DEFAULT_MAX_RANK,
    SUPPORTED_TARGETS,
    AdapterError,
    read_adapter,
    read_adapter_config,
)
from models.lora.batch import NO_ADAPTER, LoraBatch, TorchLoraBatch
from models.lora.kernel_batch import KernelLoraBatch, LoraGraphInput
from models.lora.slots import LoraSlots
from models.lora.tables import LoraTables
from models.lora.weights import LoraAdapter, LoraModule, LoraShard, LoraWeights, lora_targets

__all__ = [
    "DEFAULT_MAX_RANK",
    "NO_ADAPTER",
    "SUPPORTED_TARGETS",
    "AdapterError",
    "KernelLoraBatch",
    "LoraAdapter",
    "LoraBatch",
    "LoraGraphInput",
    "LoraModule",
    "LoraShard",
    "LoraSlots",
    "LoraTables",
    "LoraWeights",
    "TorchLoraBatch",
    "lora_targets",
    "read_adapter",
    "read_adapter_config",
]
