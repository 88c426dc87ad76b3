"""A step's LoRA work as the layers see it (ForwardContext.lora), and its plain-torch form.

A step's tokens each belong to one adapter slot or to none (NO_ADAPTER: the base). For every
module an adapter targets, y = base(x) + (x @ A[s].T) @ B[s].T over the tokens of each slot s
(scaling is in B). Two forms run it behind one interface (LoraBatch): TorchLoraBatch, here (the
CPU's, and CI's reference): per slot, the shrink and the expand as two GEMMs over that slot's
tokens, a contiguous range of them sliced, any other set gathered and scattered back; and
KernelLoraBatch (models.lora.kernel_batch: a GPU's): two Triton kernels a module over every
slot at once. LoraSlots.batch picks.
"""

from __future__ import annotations

import torch
from torch import nn

from models.lora.weights import LoraModule

NO_ADAPTER = -1  # a token of the base model


class LoraBatch:
    """One step's LoRA work (ForwardContext.lora): `token_slots` [T] on the device, each
    token's slot or NO_ADAPTER; `touches` and `add` for the layers."""

    token_slots: torch.Tensor

    def touches(self, layer: nn.Module) -> bool:
        """Whether any module of `layer` may have LoRA work in this step (its projections then
        go through ForwardContext.linear)."""
        raise NotImplementedError

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (module(x), [T, out]) with the step's deltas of `module` added in place."""
        raise NotImplementedError


class TorchLoraBatch(LoraBatch):
    """The step's LoRA work as torch GEMMs: per module of the base, each slot's delta over its
    tokens."""

    def __init__(
        self,
        token_slots: torch.Tensor,
        work: dict[int, list[tuple[LoraModule, slice | torch.Tensor]]],
    ):
        self.token_slots = token_slots  # [T] int64 on the device: each token's slot, or -1
        self._work = work  # id(module) -> [(the slot's LoraModule, its tokens)]

    def touches(self, layer: nn.Module) -> bool:
        return any(id(m) in self._work for m in layer.modules())

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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
