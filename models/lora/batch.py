"""A base model's adapter slots, and a step's LoRA work over them.

A step's tokens each belong to one slot or to none (NO_ADAPTER: the base). For every module an
adapter targets, y = base(x) + (x @ A[s].T) @ B[s].T over the tokens of each slot s (scaling is
in B). This is the plain-torch path (the CPU's, and the GPU's fallback): per slot, the shrink
and the expand as two GEMMs over that slot's tokens, a contiguous range of them sliced, any
other set gathered and scattered back.

The slot count is fixed per base (LoraSlots.num_slots): a slot table of that size can be a
captured graph's input. A slot holds an adapter's LoraWeights, views into the adapter's own
pooled buffer: assigning a slot copies nothing, and those views keep their addresses while the
buffer is evicted and activated again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.attention.upload import host_ints, upload
from models.lora.weights import LoraModule, LoraWeights, lora_targets

NO_ADAPTER = -1  # a token of the base model


class LoraSlots:
    """The adapter slots of one base model (`num_slots` of them, fixed). Not thread-safe: the
    engine thread owns it."""

    def __init__(self, base: nn.Module, num_slots: int = 8):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._slots: list[LoraWeights | None] = [None] * num_slots
        # the base's targetable modules: name -> module
        names = {t.module for t in lora_targets(base).values()}
        self._modules = {n: m for n, m in base.named_modules() if n in names}

    def __getitem__(self, slot: int) -> LoraWeights | None:
        return self._slots[slot]

    def assign(self, slot: int, weights: LoraWeights) -> None:
        """Slot `slot` runs `weights` from the next batch on (an adapter of this base)."""
        unknown = set(weights.modules) - set(self._modules)
        if unknown:
            raise ValueError(f"adapter weights for modules the base lacks: {sorted(unknown)[:3]}")
        self._slots[slot] = weights

    def clear(self, slot: int) -> None:
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
        return LoraBatch(table, work)


class LoraBatch:
    """One step's LoRA work (ForwardContext.lora): per module of the base, each slot's delta
    over its tokens."""

    def __init__(
        self,
        token_slots: torch.Tensor,
        work: dict[int, list[tuple[LoraModule, slice | torch.Tensor]]],
    ):
        self.token_slots = token_slots  # [T] int64 on the device: each token's slot, or -1
        self._work = work  # id(module) -> [(the slot's LoraModule, its tokens)]

    def touches(self, layer: nn.Module) -> bool:
        """Whether any module of `layer` has LoRA work in this step."""
        return any(id(m) in self._work for m in layer.modules())

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (module(x), [T, out]) with the step's deltas of `module` added in place."""
        for m, sel in self._work.get(id(module), ()):
            xs = x[sel]  # [n, in]: the slot's tokens
            h = xs @ m.a.T  # [n, sum of ranks]
            for s in m.shards:
                d = h[:, s.ranks] @ s.b.T  # [n, rows]
                if isinstance(sel, slice):
                    y[sel, s.rows].add_(d)
                else:
                    y[:, s.rows].index_add_(0, sel, d)
        return y
