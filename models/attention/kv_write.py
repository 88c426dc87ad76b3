"""Writing a step's K/V into the paged cache, and the rope that comes just before it.

Cache view per layer: [num_blocks, 2, block_size, H, D]. A decode step's writes go through
`RowsWriter` (an indexed store: capturable, its slots may come from a graph's static buffer). On a
GPU with Triton it also takes the layer's rope (`rope_then_write`): q and k rotated and K/V
stored in one kernel (triton_ops.rope_write), where FlashInfer's rope and the store were two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kernels import triton_ops
from models.layers.rotary_embedding import Rope


@dataclass
class KVSlots:
    """Where a step's tokens go in every layer view: block and offset of each, [T] int64."""

    blocks: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def of(slot_mapping: torch.Tensor, block_size: int) -> KVSlots:
        return KVSlots(slot_mapping // block_size, slot_mapping % block_size)


def kv_pairs(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v: [T, H, D] -> the [T, 2, H, D] view holding both when v lies right after k in every
    row, as the qkv projection's output holds them (None otherwise)."""
    t, h, d = k.shape
    if v.shape != k.shape or v.stride() != k.stride() or k.stride()[1:] != (d, 1):
        return None
    if v.data_ptr() - k.data_ptr() != h * d * k.element_size():
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None  # neighbours in memory by chance, not one tensor's rows
    return k.as_strided((t, 2, h, d), (k.stride(0), h * d, d, 1))


def write_kv(cache: torch.Tensor, at: KVSlots, k: torch.Tensor, v: torch.Tensor) -> None:
    """cache: [num_blocks, 2, block_size, H, D]; k, v: [T, H, D] -> each token's K at
    cache[block, 0, offset], its V at cache[block, 1, offset]. One kernel: k and v are read
    where they lie when v follows k (kv_pairs), else stacked first."""
    pairs = kv_pairs(k, v)
    if pairs is None:
        pairs = torch.stack((k, v), dim=1)
    cache[at.blocks, :, at.offsets] = pairs.to(cache.dtype)


class RowsWriter:
    """K/V writes as one indexed store (decode steps: capturable, the slots may come from a
    graph's static buffer). Takes the layer's rope too where Triton runs (`fuses_rope`).
    slots: [T] int64, block * block_size + offset of each token."""

    def __init__(self, slots: torch.Tensor, block_size: int):
        self.slots, self.block_size = slots, block_size
        self._at: KVSlots | None = None

    @property
    def at(self) -> KVSlots:
        if self._at is None:  # only the unfused store needs them (two kernels a step)
            self._at = KVSlots.of(self.slots, self.block_size)
        return self._at

    def __call__(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(cache, self.at, k, v)

    def fuses_rope(self, cache: torch.Tensor) -> bool:
        """Whether this writer can take the layer's rope too (one Triton kernel)."""
        return triton_ops.triton_runs_on(cache.device)

    def rope_and_write(
        self, cache: torch.Tensor, q, k, v, rope: Rope, contiguous_q: bool
    ) -> torch.Tensor:
        """q, k rotated (q into a new contiguous tensor when `contiguous_q` and it is not), k
        and v stored at the step's slots -> q."""
        q_out = q
        if contiguous_q and not q.is_contiguous():
            q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return triton_ops.rope_write(q, k, v, rope.table(), self.slots, cache, q_out)


def rope_then_write(
    write, cache: torch.Tensor, q, k, v, rope: Rope | None, contiguous_q: bool = False
) -> torch.Tensor:
    """A layer's rope (when given: q and k not yet rotated) and its K/V write (when `write`):
    one kernel where the writer fuses them -> the rotated q."""
    if rope is not None and isinstance(write, RowsWriter) and write.fuses_rope(cache):
        return write.rope_and_write(cache, q, k, v, rope, contiguous_q)
    if rope is not None:
        q, k = rope.apply(q, k, contiguous=contiguous_q)
    if write is not None:
        write(cache, k, v)
    return q
