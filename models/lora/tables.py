"""Where each slot's adapter weights lie, for the LoRA kernels (models.kernels.triton_lora).

One int64 table on the device per base: for every module an adapter may target, a row per
slot: A's address, then per shard of the module (q/k/v of qkv_proj, gate/up of gate_up_proj,
or the one), B's address, its rank (0: the slot's adapter leaves the shard alone, or the slot
is empty) and its first row of A. Assigning a slot rewrites its rows (a copy of a few KB,
queued on the stream); the table's address never changes, so graphs captured over it replay
whatever the slots hold. The weights stay in their adapters' own buffers, whose views keep
their addresses while evicted (a slot's weights are read only for its tokens, and a step runs
an adapter's tokens only while it is resident).
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention.upload import host_ints, upload
from models.lora.weights import LoraWeights, lora_targets


class LoraTables:
    """The kernels' view of a base's slots: `table` [modules, slots, 1 + 3 J] int64 and
    `bounds` [modules, J + 1] int32 (shard j of a module: its output columns bounds[j] ..
    bounds[j + 1]; J the most shards of a module)."""

    def __init__(self, base: nn.Module, num_slots: int, device: torch.device, dtype: torch.dtype):
        shards: dict[str, list[tuple[str, slice]]] = {}  # module -> [(shard, rows)] by rows
        for t in lora_targets(base).values():
            shards.setdefault(t.module, []).append((t.shard, t.rows))
        by_name = dict(base.named_modules())
        self.names = sorted(shards)
        self.index = {id(by_name[n]): i for i, n in enumerate(self.names)}
        self.num_slots, self.device, self.dtype = num_slots, device, dtype
        self.max_shards = max((len(s) for s in shards.values()), default=1)
        # name -> (its index, shard name -> j); per module (shards, widest shard's columns)
        self._shard_of: dict[str, tuple[int, dict[str, int]]] = {}
        self.shape: list[tuple[int, int]] = []
        bounds = []
        for i, name in enumerate(self.names):
            ordered = sorted(shards[name], key=lambda s: s[1].start)
            self._shard_of[name] = (i, {s: j for j, (s, _) in enumerate(ordered)})
            edges = [ordered[0][1].start] + [rows.stop for _, rows in ordered]
            edges += [edges[-1]] * (self.max_shards + 1 - len(edges))
            bounds.append(edges)
            self.shape.append((len(ordered), max(r.stop - r.start for _, r in ordered)))
        cols = 1 + 3 * self.max_shards
        self.table = torch.zeros(len(self.names), num_slots, cols, dtype=torch.int64, device=device)
        self.bounds = torch.tensor(bounds, dtype=torch.int32).to(device)

    def set(self, slot: int, weights: LoraWeights | None) -> None:
        """Slot `slot`'s rows: `weights`'s addresses and ranks (None: an empty slot)."""
        rows = [[0] * self.table.shape[2] for _ in self.names]
        for name, m in (weights.modules if weights is not None else {}).items():
            i, shard_of = self._shard_of[name]
            k = m.a.shape[1]
            self._check(m.a, (m.a.shape[0], k))
            rows[i][0] = m.a.data_ptr()
            for s in m.shards:
                j = shard_of[s.name]
                rank = s.ranks.stop - s.ranks.start
                self._check(s.b, (s.rows.stop - s.rows.start, rank))
                rows[i][1 + 3 * j : 4 + 3 * j] = [s.b.data_ptr(), rank, s.ranks.start]
        host = host_ints([v for r in rows for v in r], torch.int64).view(len(rows), -1)
        (dev,) = upload([host], self.device)
        self.table[:, slot].copy_(dev)

    def _check(self, t: torch.Tensor, shape: tuple[int, int]) -> None:
        if t.device != self.device or t.dtype != self.dtype:
            raise ValueError(f"adapter weights on {t.device} in {t.dtype}, want {self.device} "
                             f"in {self.dtype}")  # fmt: skip
        if tuple(t.shape) != shape or t.stride() != (shape[1], 1):
            raise ValueError(f"adapter weights of shape {tuple(t.shape)} strided {t.stride()}")
