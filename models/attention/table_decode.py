"""Decode attention through a kernel that reads the block table itself (the Triton kernel of
triton_ops): no plan, no CSR index. A step hands the kernel its [B, W] int32 block
tables and [B, 1] int32 lengths as the allocator keeps them; a captured graph has its own fixed
copies, refilled before each replay. The query is contiguous [B, Hq, D] (the rope writes it so).
"""

from __future__ import annotations

from typing import Protocol

import torch

from models.attention.base import AttentionMetadata, LayerAttention
from models.attention.kv_write import RowsWriter, rope_then_write


class DecodeKernel(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        """q: [B, Hq, D]; cache: one layer's view; tables: [B, W] int32; seq_lens: [B, 1] int32
        -> [B, Hq, D]."""
        ...


class TableDecodeAttention:
    """The decode attention of one eager step: md's device block tables and lengths as they
    are (its table is as wide as the step's longest sequence)."""

    contiguous_q = True  # the model's rope writes q contiguous (ForwardContext.contiguous_q)

    def __init__(
        self, kernel: DecodeKernel, kv_caches: list[torch.Tensor], md: AttentionMetadata, write
    ):
        self.kernel, self.kv_caches, self.write = kernel, kv_caches, write
        self.tables = md.block_tables  # [B, W] int32
        self.seq_lens = md.seq_lens.view(-1, 1)  # [B, 1] int32

    @property
    def takes_rope(self) -> bool:
        """Whether forward() can take the layer's rope with its K/V write (ForwardContext)."""
        return isinstance(self.write, RowsWriter) and self.write.fuses_rope(self.kv_caches[0])

    def forward(
        self, layer_idx: int, q, k, v, spec: LayerAttention, rope=None, out=None
    ) -> torch.Tensor:
        # q: [B, Hq, D]; k, v: [B, Hkv, D] -> [B, Hq, D]; rope: q and k not yet rotated; out:
        # where the output goes (a piecewise graph's static buffer; None: the kernel's own)
        cache = self.kv_caches[layer_idx]
        write = self.write
        if rope is not None and getattr(self.kernel, "takes_rope", False):
            # the kernel rotates q and k and stores k, v itself (write.fuses_rope: takes_rope)
            new = (k, v, rope.table(), write.slots)
            o = self.kernel(q, cache, self.tables, self.seq_lens, spec, new)
        else:
            q = rope_then_write(write, cache, q, k, v, rope, contiguous_q=True)
            o = self.kernel(q, cache, self.tables, self.seq_lens, spec)
        return o if out is None else out.copy_(o)


class TableDecodeGraphAttention(TableDecodeAttention):
    """Decode attention for one captured batch size: a fixed [batch_size, max_blocks] table
    and fixed lengths, refilled outside the graph before each replay. Padded rows are one token
    long in block 0 (the null block)."""

    def __init__(
        self,
        kernel: DecodeKernel,
        kv_caches: list[torch.Tensor],
        batch_size: int,
        max_blocks: int,
        rows_writer,
    ):
        """rows_writer: the step's static slots [batch_size] -> its K/V writer."""
        dev = kv_caches[0].device
        self.kernel, self.kv_caches = kernel, kv_caches
        self.batch_size, self.max_blocks = batch_size, max_blocks
        self.tables = torch.zeros(batch_size, max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.seq_lens = self.lens.view(-1, 1)
        self.slots = torch.zeros(batch_size, dtype=torch.int64, device=dev)  # [bs] static
        self._rows_writer = rows_writer  # slots -> the step's K/V writer, inside the graph
        self.write = None

    def fits(self, md: AttentionMetadata) -> bool:
        return md.num_seqs <= self.batch_size and md.block_tables.shape[1] <= self.max_blocks

    def plan(self, md: AttentionMetadata) -> None:
        """Refill the table, lengths and slots for md's decode batch. Columns past a sequence's
        last block are never read (the kernel stops at its length), so only the padded rows'
        first column is reset to the null block."""
        assert md.is_decode_only and self.fits(md), (md.num_seqs, self.batch_size)
        b, w = md.num_seqs, md.block_tables.shape[1]
        self.tables[:b, :w].copy_(md.block_tables)
        self.lens[:b].copy_(md.seq_lens)
        self.slots[:b].copy_(md.slot_mapping)
        if b < self.batch_size:
            self.tables[b:, 0] = 0
            self.lens[b:] = 1
            self.slots[b:] = 0  # padded rows write the null block

    def prepare(self) -> None:
        """Per-step work that belongs inside the graph: K/V rows from the static slots."""
        self.write = self._rows_writer(self.slots)
