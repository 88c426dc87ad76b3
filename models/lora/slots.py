"""A base model's adapter slots, and a step's LoRA work over them.

The slot count is fixed per base (LoraSlots.num_slots): a slot table of that size can be a
captured graph's input. A slot holds an adapter's LoraWeights, views into the adapter's own
pooled buffer: assigning a slot copies no weights, and those views keep their addresses while
the buffer is evicted and activated again.

Where the LoRA kernels run (`kernels`: by default on a CUDA device with Triton), a step's work
is a KernelLoraBatch over the slots' LoraTables, and decode graphs can take it (graph_input);
elsewhere (the CPU) a TorchLoraBatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.attention.upload import host_ints, upload
from models.kernels.triton_ops import _pow2, triton_runs_on
from models.lora.adapter import DEFAULT_MAX_RANK, activation_dtype
from models.lora.batch import NO_ADAPTER, LoraBatch, TorchLoraBatch
from models.lora.kernel_batch import KernelLoraBatch, LoraGraphInput
from models.lora.tables import LoraTables
from models.lora.weights import LoraModule, LoraWeights, lora_targets


def kernels_by_default(device: torch.device) -> bool:
    """Whether a base on `device` runs its LoRA work through the kernels unless told: on a GPU
    where Triton runs (the CPU keeps the torch GEMMs, the reference)."""
    return device.type == "cuda" and triton_runs_on(device)


class LoraSlots:
    """The adapter slots of one base model (`num_slots` of them, fixed), of adapters of rank at
    most `max_rank`. kernels: the step's work through the LoRA kernels (None: where they run by
    default). Not thread-safe: the engine thread owns it."""

    def __init__(
        self,
        base: nn.Module,
        num_slots: int = 8,
        max_rank: int = DEFAULT_MAX_RANK,
        kernels: bool | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.num_slots, self.max_rank = num_slots, max_rank
        self._slots: list[LoraWeights | None] = [None] * num_slots
        # the base's targetable modules: name -> module
        names = {t.module for t in lora_targets(base).values()}
        self._modules = {n: m for n, m in base.named_modules() if n in names}
        device = next(base.parameters()).device
        self.kernels = kernels_by_default(device) if kernels is None else kernels
        self.tables: LoraTables | None = None
        if self.kernels:
            self.tables = LoraTables(base, num_slots, device, activation_dtype(base))
        self.rank_block = max(16, _pow2(max_rank))  # the kernels' ranks, masked to each's

    def __getitem__(self, slot: int) -> LoraWeights | None:
        return self._slots[slot]

    def assign(self, slot: int, weights: LoraWeights) -> None:
        """Slot `slot` runs `weights` from the next batch on (an adapter of this base)."""
        unknown = set(weights.modules) - set(self._modules)
        if unknown:
            raise ValueError(f"adapter weights for modules the base lacks: {sorted(unknown)[:3]}")
        rank = max((s.ranks.stop - s.ranks.start for m in weights.modules.values()
                    for s in m.shards), default=0)  # fmt: skip
        if rank > self.max_rank:
            raise ValueError(f"adapter weights of rank {rank}, past the slots' {self.max_rank}")
        if self.tables is not None:
            self.tables.set(slot, weights)
        self._slots[slot] = weights

    def clear(self, slot: int) -> None:
        if self.tables is not None:
            self.tables.set(slot, None)
        self._slots[slot] = None

    def free_slot(self) -> int | None:
        """A slot holding no adapter, or None."""
        return next((i for i, w in enumerate(self._slots) if w is None), None)

    def batch(self, token_slots: Sequence[int], device: torch.device) -> LoraBatch | None:
        """A step's LoRA work: token_slots[i], the slot of the step's token i (NO_ADAPTER: the
        base), on `device`; None when no token has an adapter (the step runs as the base's)."""
        tokens: dict[int, list[int]] = {}  # slot -> its tokens' indices, ascending
        for i, s in enumerate(token_slots):
            if s != NO_ADAPTER:
                tokens.setdefault(s, []).append(i)
        if not tokens:
            return None
        present = sorted(tokens)
        for s in present:
            if not 0 <= s < self.num_slots or self._slots[s] is None:
                raise ValueError(f"tokens of slot {s}, which holds no adapter")
        if self.tables is not None:
            modules = {id(self._modules[n]) for s in present for n in self._slots[s].modules}
            return KernelLoraBatch.for_step(
                self.tables, token_slots, self.rank_block, modules, device
            )
        sels: list[slice | int] = []
        gathered: list[torch.Tensor] = []  # host index lists, uploaded together
        for s in present:
            idx = tokens[s]
            if idx[-1] - idx[0] + 1 == len(idx):
                sels.append(slice(idx[0], idx[-1] + 1))
            else:
                sels.append(len(gathered))  # placeholder: the index's position
                gathered.append(host_ints(idx, torch.int64))
        table = host_ints(list(token_slots), torch.int64)
        table, *indices = upload([table, *gathered], device)
        work: dict[int, list[tuple[LoraModule, slice | torch.Tensor]]] = {}
        for s, sel in zip(present, sels):
            if isinstance(sel, int):
                sel = indices[sel]
            for name, m in self._slots[s].modules.items():
                work.setdefault(id(self._modules[name]), []).append((m, sel))
        return TorchLoraBatch(table, work)

    def graph_input(self, capacity: int) -> LoraGraphInput:
        """A static LoRA input for decode graphs of at most `capacity` tokens (the kernels
        only)."""
        if self.tables is None:
            raise RuntimeError("LoRA in graphs needs the LoRA kernels (LoraSlots.kernels)")
        return LoraGraphInput(self.tables, self.rank_block, capacity)
