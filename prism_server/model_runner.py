"""Turns a scheduled batch into tensors once per step and runs the model over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpool import KVCache
from models.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from scheduler.batch_scheduler import ScheduledChunk

AttentionFactory = Callable[[list[torch.Tensor], AttentionMetadata], AttentionBackend]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        attention: AttentionFactory = TorchPagedAttention,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attention = attention
        self.block_size = kv_cache.layout.block_size

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledChunk]) -> torch.Tensor:
        """Runs one step; returns float32 logits [num_sampling_requests, vocab] for the chunks
        that reach the end of their request's tokens, in batch order."""
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []  # index in the flat stream of each sampling chunk's last token
        for c in batch:
            start = c.request.num_computed_tokens
            ids.extend(c.request.all_token_ids[start : start + c.num_new])
            positions.extend(range(start, start + c.num_new))
            if c.samples:
                last.append(len(ids) - 1)
        chunks = [
            SeqChunk(c.request.num_computed_tokens, c.num_new, c.request.block_table) for c in batch
        ]
        md = AttentionMetadata.build(chunks, self.block_size, self.device)
        ctx = ForwardContext(attn=self.attention(self.kv_cache.layer_views, md))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, ctx)
        if not last:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
