"""The attention backend interface: how a model's attention layers reach the paged KV cache.

A step runs a flat stream of T tokens from B sequences. Sequence i contributes the tokens at
positions [num_computed_i, num_computed_i + num_new_i); its K/V for all earlier positions already
sit in the paged cache. All layers share one block table per sequence (kvpool's layout): block
index g of layer l lives in row g of layer l's cache view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from models.attention.upload import host_ints, upload

if TYPE_CHECKING:
    from models.kernels.fused_decode import StepOps
    from models.layers.rotary_embedding import Rope
    from models.lora import LoraBatch


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

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same metadata on another device: its device tensors copied there (without
        waiting), its host copies shared."""
        if device == self.slot_mapping.device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            slot_mapping=move(self.slot_mapping),
            query_start_loc=move(self.query_start_loc),
            seq_lens=move(self.seq_lens),
            block_tables=move(self.block_tables),
        )

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
        """The metadata of a step of `chunks` (on `device`, in one transfer)."""
        return AttentionMetadata.build_with(chunks, block_size, device)[0]

    @staticmethod
    def build_with(
        chunks: Sequence[SeqChunk],
        block_size: int,
        device: torch.device,
        riders: Sequence[torch.Tensor] = (),
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """The metadata, and `riders` (host tensors: a step's tokens and positions) on the
        device, all in one transfer (each transfer costs the host a pinned buffer and a copy
        before the step's first kernel)."""
        query_lens = [c.num_new for c in chunks]
        seq_lens = [c.num_computed + c.num_new for c in chunks]
        max_blocks = max((-(-s // block_size) for s in seq_lens), default=1)
        flat: list[int] = []  # the block tables row after row, padded with the null block (0)
        slots: list[torch.Tensor] = []
        short: list[int] = []  # slots of the short chunks since the last long one
        for i, (c, end) in enumerate(zip(chunks, seq_lens)):
            n, table = -(-end // block_size), c.block_table
            if len(table) < n:
                raise ValueError(f"sequence {i} needs {n} blocks, has {len(table)}")
            flat.extend(table[:n])
            flat.extend([0] * (max_blocks - n))
            if c.num_new > 16:  # long chunks: vectorized
                if short:
                    slots.append(host_ints(short, torch.int64))
                    short = []
                slots.append(_chunk_slots(table, c.num_computed, c.num_new, block_size))
                continue
            for pos in range(c.num_computed, end):
                short.append(table[pos // block_size] * block_size + pos % block_size)
        if short or not slots:
            slots.append(host_ints(short, torch.int64))
        slot_mapping = slots[0] if len(slots) == 1 else torch.cat(slots)
        tables = host_ints(flat, torch.int32).view(len(chunks), max_blocks)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        host = (
            slot_mapping,
            host_ints(qsl, torch.int32),
            host_ints(seq_lens, torch.int32),
            tables,
        )
        # one copy, never waiting for the device
        slot_dev, qsl_dev, seq_dev, tables_dev, *rode = upload((*host, *riders), device)
        md = AttentionMetadata(
            block_size=block_size,
            slot_mapping=slot_dev,
            query_start_loc=qsl_dev,
            seq_lens=seq_dev,
            block_tables=tables_dev,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=tables,
        )
        return md, rode


def _chunk_slots(table: Sequence[int], start: int, count: int, block_size: int) -> torch.Tensor:
    """The slots of positions start .. start+count-1 of a sequence with block table `table`:
    [count] int64, block * block_size + offset."""
    first, end = start // block_size, -(-(start + count) // block_size)
    blocks = host_ints(table[first:end], torch.int64)
    grid = blocks[:, None] * block_size + torch.arange(block_size)  # [blocks, block_size]
    skip = start - first * block_size
    return grid.view(-1)[skip : skip + count]


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer asks of the backend (fixed per layer)."""

    scale: float
    sliding_window: int | None = None  # attend to the last `sliding_window` positions only
    logit_softcap: float | None = None


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache and computes attention over cache + new tokens.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]
    (into `out` when given: a piecewise graph's static buffer).
    """

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    """Everything a model's forward needs beyond token ids and positions, passed explicitly
    (several models share the process, so there is no global forward context). reduce: for a
    shard of a tensor-parallel model, the sum over the shards of a layer's partial output (None:
    the model is whole). lora: the step's adapter work (models.lora.LoraSlots.batch; None: every
    token is the base's, and the step runs as it would without adapters)."""

    attn: AttentionBackend
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a small decode step's layers as chains of Triton kernels (models.kernels.fused_decode)
    step_ops: StepOps | None = None
    lora: LoraBatch | None = None

    @property
    def contiguous_q(self) -> bool:
        """Whether the backend reads the query as a contiguous [T, Hq, D] (its rope then writes
        a new tensor rather than rotating the qkv projection's strided view in place)."""
        return getattr(self.attn, "contiguous_q", False)

    def linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x), or the step ops' kernel for it (a small step's GEMM: StepOps.linear),
        plus the step's LoRA deltas of the module where it has some."""
        y = module(x) if self.step_ops is None else self.step_ops.linear(module, x)
        return y if self.lora is None else self.lora.add(module, x, y)

    def has_lora(self, layer: torch.nn.Module) -> bool:
        """Whether a module of `layer` has LoRA work in this step (then its projections must go
        through `linear`)."""
        return self.lora is not None and self.lora.touches(layer)

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
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """rope: the step's rotary table, for q and k not yet rotated. A backend that can
        (`takes_rope`) applies it with its K/V write, in one kernel; else it is applied here."""
        if rope is not None:
            if getattr(self.attn, "takes_rope", False):
                return self.attn.forward(layer_idx, q, k, v, spec, rope=rope)
            q, k = rope.apply(q, k, contiguous=self.contiguous_q)
        return self.attn.forward(layer_idx, q, k, v, spec)


def layer_specs(model: torch.nn.Module) -> list[LayerAttention]:
    """The distinct LayerAttention specs of a model's attention layers (one plan each per step)."""
    seen: dict[LayerAttention, None] = {}
    for m in model.modules():
        spec = getattr(m, "spec", None)
        if isinstance(spec, LayerAttention):
            seen.setdefault(spec)
    return list(seen)
