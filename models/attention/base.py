"""The attention backend interface: how a model's attention layers reach the paged KV cache.

A step runs a flat stream of T tokens from B sequences. Sequence i contributes the tokens at
positions [num_computed_i, num_computed_i + num_new_i); its K/V for all earlier positions already
sit in the paged cache. All layers share one block table per sequence (kvpool's layout): block
index g of layer l lives in row g of layer l's cache view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step."""

    num_computed: int  # tokens whose K/V are already cached
    num_new: int  # tokens computed in this step
    block_table: Sequence[int]  # block indices covering at least num_computed + num_new tokens


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's tokens start in the stream
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (the null block)
    # Host copies for backends that loop or plan on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: torch.Tensor | None = None  # block_tables on the host

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)

    @staticmethod
    def build(
        chunks: Sequence[SeqChunk], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        query_lens = [c.num_new for c in chunks]
        seq_lens = [c.num_computed + c.num_new for c in chunks]
        max_blocks = max((-(-s // block_size) for s in seq_lens), default=1)
        rows: list[list[int]] = []
        slots: list[int] = []
        long_chunks: list[tuple[int, int]] = []  # (sequence, where its slots start in `slots`)
        for i, c in enumerate(chunks):
            n = -(-seq_lens[i] // block_size)
            if len(c.block_table) < n:
                raise ValueError(f"sequence {i} needs {n} blocks, has {len(c.block_table)}")
            rows.append([*c.block_table[:n], *[0] * (max_blocks - n)])
            if c.num_new > 16:  # long chunks: vectorized below; placeholders keep the order
                long_chunks.append((i, len(slots)))
                slots.extend([0] * c.num_new)
                continue
            for pos in range(c.num_computed, c.num_computed + c.num_new):
                slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        tables = torch.tensor(rows, dtype=torch.int32).view(len(chunks), max_blocks)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        for i, start in long_chunks:
            pos = torch.arange(chunks[i].num_computed, seq_lens[i])
            blocks = tables[i].long()[pos // block_size]
            slot_mapping[start : start + len(pos)] = blocks * block_size + pos % block_size
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)

        def dev(t: torch.Tensor) -> torch.Tensor:
            # NOTE: asynchronous from pageable memory (the driver stages it before returning), so
            # building metadata never waits for the device to drain.
            return t.to(device, non_blocking=True)

        return AttentionMetadata(
            block_size=block_size,
            slot_mapping=dev(slot_mapping),
            query_start_loc=dev(torch.tensor(qsl, dtype=torch.int32)),
            seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=dev(tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=tables,
        )


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer asks of the backend (fixed per layer)."""

    scale: float
    sliding_window: int | None = None  # attend to the last `sliding_window` positions only
    logit_softcap: float | None = None


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache and computes attention over cache + new tokens.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim].
    """

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    """Everything a model's forward needs beyond token ids and positions, passed explicitly
    (several models share the process, so there is no global forward context). reduce: for a
    shard of a tensor-parallel model, the sum over the shards of a layer's partial output (None:
    the model is whole)."""

    attn: AttentionBackend
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def contiguous_q(self) -> bool:
        """Whether the backend reads the query as a contiguous [T, Hq, D] (its rope then writes
        a new tensor rather than rotating the qkv projection's strided view in place)."""
        return getattr(self.attn, "contiguous_q", False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the model's shards (x itself for a whole model)."""
        return x if self.reduce is None else self.reduce(x)

    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        return self.attn.forward(layer_idx, q, k, v, spec)


def layer_specs(model: torch.nn.Module) -> list[LayerAttention]:
    """The distinct LayerAttention specs of a model's attention layers (one plan each per step)."""
    seen: dict[LayerAttention, None] = {}
    for m in model.modules():
        spec = getattr(m, "spec", None)
        if isinstance(spec, LayerAttention):
            seen.setdefault(spec)
    return list(seen)
