"""An adapter's tensors, per projection of its base model, and where they live.

A LoRA delta of a projection W [out, in] is scaling * B @ A with A [r, in], B [out, r]. Prism
keeps scaling folded into B, and one LoraModule per module of its model: q/k/v share the
qkv_proj module and gate/up the gate_up_proj one (models.layers.merged_linear), so their A's are
stacked into one [sum r, in] (one shrink GEMM) and each B fills its shard's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# the HF projections an adapter may target (PEFT's target_modules)
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (name, shape, dtype) of every tensor -> name -> a tensor of that shape and dtype to use as it
# (models.loader's Placement: views into a pooled weight buffer)
Placement = Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LoraTarget:
    """Where one HF projection of the base sits in Prism's model."""

    module: str  # the module's name, e.g. model.layers.3.self_attn.qkv_proj
    shard: str  # the HF projection, e.g. q_proj
    rows: slice  # its rows of the module's output
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.stop - self.rows.start


def lora_targets(model: nn.Module) -> dict[str, LoraTarget]:
    """The projections of `model` an adapter may target, by HF module path (PEFT's names
    without their prefix: model.layers.3.self_attn.q_proj). A projection is any module with
    in_features and out_features (nn.Linear, or a quantized one), a merged one with `shards`
    and shard_rows (MergedLinear's form)."""
    targets: dict[str, LoraTarget] = {}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "in_features") and hasattr(mod, "out_features")):
            continue
        parent, _, leaf = name.rpartition(".")
        merged = getattr(mod, "shards", None)
        for shard in list(merged) if merged else [leaf]:
            if shard not in SUPPORTED_TARGETS:
                continue
            rows = mod.shard_rows(shard) if merged else slice(0, mod.out_features)
            path = f"{parent}.{shard}" if parent else shard
            targets[path] = LoraTarget(name, shard, rows, mod.in_features)
    return targets


@dataclass(frozen=True)
class LoraShard:
    """One HF projection's expand: its rows of the module's output from its columns of the
    shrink's output."""

    name: str  # the HF projection (q_proj, ...)
    rows: slice  # of the module's output
    ranks: slice  # of the module's shrink output (x @ a.T)
    b: torch.Tensor  # [rows, rank], scaling folded in


@dataclass(frozen=True)
class LoraModule:
    """An adapter's delta on one module of the base: y += (x @ a.T)[:, ranks] @ b.T per shard."""

    a: torch.Tensor  # [sum of the shards' ranks, in]
    shards: tuple[LoraShard, ...]


@dataclass(frozen=True)
class LoraWeights:
    """An adapter's LoraModules by module name (model.layers.3.self_attn.qkv_proj)."""

    modules: dict[str, LoraModule]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor, in a fixed order (the pooled layout's)."""
        for name, m in self.modules.items():
            yield f"{name}.lora_A", m.a
            for s in m.shards:
                yield f"{name}.lora_B.{s.name}", s.b

    def layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every tensor: what a Placement packs."""
        return [(n, tuple(t.shape), t.dtype) for n, t in self.named_tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    def over(self, tensors: dict[str, torch.Tensor]) -> LoraWeights:
        """The same modules over other tensors of the same names (a placement's views)."""

        def module(name: str, m: LoraModule) -> LoraModule:
            shards = tuple(
                LoraShard(s.name, s.rows, s.ranks, tensors[f"{name}.lora_B.{s.name}"])
                for s in m.shards
            )
            return LoraModule(tensors[f"{name}.lora_A"], shards)

        return LoraWeights({n: module(n, m) for n, m in self.modules.items()})


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read and validated against its base (read_adapter), its tensors on the host
    in the base's dtype."""

    name: str
    path: Path
    rank: int  # the largest of its modules' ranks
    targets: tuple[str, ...]  # the HF projections it adapts, in SUPPORTED_TARGETS order
    weights: LoraWeights  # host tensors

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def place(self, place: Placement) -> LoraWeights:
        """Its tensors copied into the storage `place` gives (views of one pooled buffer, the
        owner named after the adapter); the LoraWeights over that storage."""
        layout = self.weights.layout()
        storage = place(layout)
        for name, t in self.weights.named_tensors():
            dst = storage[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise ValueError(f"placement of {name}: {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(t)
        return self.weights.over(storage)
