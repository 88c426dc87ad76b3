"""A step's LoRA work as the Triton kernels (models.kernels.triton_lora) over every slot at once,
eagerly or inside a decode graph.

Eagerly (KernelLoraBatch.for_step), the step's tokens grouped by slot are uploaded with it and
only the modules its slots' adapters target are touched. A base's decode graphs are captured
over LoraGraphInput: its static buffer of grouped tokens, refilled before each replay (`fill`:
NO_ADAPTER for the base's tokens and the padded rows), and a batch touching every module an
adapter may target, since any slot's adapter may run in a later replay. A graph's launches
cover a number of tiles (`tiles_for`: a power of 2), so a step replays the graph of its size
and its tiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.attention.upload import host_ints, upload
from models.kernels.triton_lora import (
    DECODE_BLOCK_M,
    TokenGroups,
    expand,
    max_tiles,
    pack_groups,
    shrink,
)
from models.lora.batch import LoraBatch
from models.lora.tables import LoraTables


class KernelLoraBatch(LoraBatch):
    """The step's LoRA work as two kernels a module (shrink, expand) over its grouped tokens.
    modules: ids of the modules with work (None: every module of the tables)."""

    def __init__(
        self, tables: LoraTables, groups: TokenGroups, rank_block: int, modules: set[int] | None
    ):
        self.tables, self.groups, self.rank_block = tables, groups, rank_block
        self.token_slots = groups.token_slots
        self._modules = modules

    @classmethod
    def for_step(
        cls,
        tables: LoraTables,
        token_slots: Sequence[int],
        rank_block: int,
        modules: set[int],
        device: torch.device,
    ) -> KernelLoraBatch:
        """An eager step's: its grouped tokens uploaded (one copy)."""
        values, tiles, block_m = pack_groups(token_slots, tables.num_slots, len(token_slots))
        (buf,) = upload([host_ints(values, torch.int32)], device)
        groups = TokenGroups(buf, len(token_slots), tables.num_slots, block_m, tiles)
        return cls(tables, groups, rank_block, modules)

    def touches(self, layer: nn.Module) -> bool:
        ids = self.tables.index if self._modules is None else self._modules
        return any(id(m) in ids for m in layer.modules())

    def add(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        i = self.tables.index.get(id(module))
        if i is None or (self._modules is not None and id(module) not in self._modules):
            return y
        shards, widest = self.tables.shape[i]
        table = self.tables.table[i]  # [slots, 1 + 3 J]
        h = shrink(x, table, self.groups, shards, self.rank_block)
        return expand(h, y, table, self.tables.bounds[i], self.groups, widest)


class LoraGraphInput:
    """The LoRA input of a base's decode graphs (batches of at most `capacity` tokens): a
    static buffer of grouped tokens (TokenGroups' layout), refilled before each replay."""

    def __init__(self, tables: LoraTables, rank_block: int, capacity: int):
        self.tables, self.rank_block, self.capacity = tables, rank_block, capacity
        values, _, _ = self._pack([])
        self.buf = torch.tensor(values, dtype=torch.int32).to(tables.device)

    def _pack(self, token_slots: Sequence[int]) -> tuple[list, int, int]:
        return pack_groups(token_slots, self.tables.num_slots, self.capacity, DECODE_BLOCK_M)

    def tiles_for(self, token_slots: Sequence[int], size: int) -> int:
        """The tiles a graph of `size` tokens launches for these tokens' LoRA work: a power of
        2 at least theirs (a graph each, few programs idle), at most what `size` tokens can
        have."""
        _, tiles, _ = self._pack(token_slots)  # (pack_groups' tiling, not a second count)
        most = max_tiles(size, self.tables.num_slots, DECODE_BLOCK_M)
        return min(1 << max(tiles - 1, 0).bit_length(), most)

    def batch(self, size: int, tiles: int) -> KernelLoraBatch:
        """The work of a graph of `size` tokens (captured over it), launching `tiles` tiles
        (`tiles_for`)."""
        groups = TokenGroups(self.buf, self.capacity, self.tables.num_slots, DECODE_BLOCK_M, tiles)
        return KernelLoraBatch(self.tables, groups, self.rank_block, None)

    def fill(self, token_slots: Sequence[int]) -> None:
        """The next replay's tokens: token_slots[i], the slot of token i (NO_ADAPTER: the
        base's); the rows past them are no adapter's. Queued on the current stream."""
        values, _, _ = self._pack(token_slots)
        (dev,) = upload([host_ints(values, torch.int32)], self.buf.device)
        self.buf.copy_(dev, non_blocking=True)
