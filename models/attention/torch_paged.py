"""Pure-torch paged attention: the reference backend (CPU and GPU).

Cache view per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (K at [:, 0], V at
[:, 1]), the layout kvpool hands out and FlashInfer's NHD single-tensor form reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention.base import AttentionMetadata, LayerAttention


def _attend(q, k, v, mask, spec: LayerAttention) -> torch.Tensor:
    """q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; mask: [B, 1, Lq, Lk] bool (True = attend)."""
    if spec.logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=spec.scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _window_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, seq_len: torch.Tensor, window):
    """q_pos: [B, Lq]; kv_pos: [Lk]; seq_len: [B] -> [B, 1, Lq, Lk] bool."""
    kv = kv_pos.view(1, 1, -1)
    qp = q_pos.unsqueeze(-1)
    mask = (kv <= qp) & (kv < seq_len.view(-1, 1, 1))
    if window is not None:
        mask &= kv > qp - window
    return mask.unsqueeze(1)


class TorchPagedAttention:
    """Attention over the paged cache for one step (construct once per step)."""

    def __init__(self, kv_caches: list[torch.Tensor], md: AttentionMetadata):
        self.kv_caches = kv_caches
        self.md = md
        bs = md.block_size
        self._slot_block = md.slot_mapping // bs
        self._slot_off = md.slot_mapping % bs
        self._decode = md.is_decode_only
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self._past: torch.Tensor | None = None  # _past_end's, built once

    def _write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # cache[block, :, offset] is [T, 2, Hkv, D]: K and V of each new token in one write
        cache[self._slot_block, :, self._slot_off] = torch.stack((k, v), dim=1).to(cache.dtype)

    def _decode_mask(self, window: int | None, device) -> torch.Tensor | None:
        """[B, 1, 1, max_len] for a decode step, built once per step and window; None when
        every sequence attends to every cached position."""
        if window not in self._masks:
            md = self.md
            lens = md.seq_lens_cpu
            if len(set(lens)) == 1 and (window is None or window >= lens[0]):
                self._masks[window] = None
            else:
                pos = (md.seq_lens.long() - 1).unsqueeze(-1)  # [B, 1]
                kv_pos = torch.arange(max(lens), device=device)
                self._masks[window] = _window_mask(pos, kv_pos, md.seq_lens.long(), window)
        return self._masks[window]

    def _past_end(self, max_len: int, device) -> torch.Tensor:
        """[B, 1, max_len, 1] bool: the positions past each sequence's end (built once)."""
        if self._past is None:
            kv_pos = torch.arange(max_len, device=device).view(1, -1)
            past = kv_pos >= self.md.seq_lens.long().view(-1, 1)
            self._past = past.view(past.shape[0], 1, max_len, 1)
        return self._past

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, max_len: int):
        """tables: [B, nb] -> K, V as [B, Hkv, max_len, D]."""
        kv = cache[tables.long()]  # [B, nb, 2, bs, Hkv, D]
        b, nb, _, bs, h, d = kv.shape
        kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, b, h, nb * bs, d)[:, :, :, :max_len]
        return kv[0], kv[1]

    def forward(self, layer_idx: int, q, k, v, spec: LayerAttention, out=None) -> torch.Tensor:
        """out: where the output goes (None: a new tensor)."""
        o = self._attend(layer_idx, q, k, v, spec)
        return o if out is None else out.copy_(o)

    def _attend(self, layer_idx: int, q, k, v, spec: LayerAttention) -> torch.Tensor:
        cache = self.kv_caches[layer_idx]
        self._write(cache, k, v)
        md = self.md
        if self._decode:
            max_len = max(md.seq_lens_cpu)
            nb = -(-max_len // md.block_size)
            kc, vc = self._gather(cache, md.block_tables[:, :nb], max_len)
            if len(set(md.seq_lens_cpu)) > 1:
                # a shorter sequence's positions past its end hold whatever its pages held
                # before (another model's weights, say): masked, yet a NaN there would still
                # reach the sums (0 * NaN), so they are zeroed
                past = self._past_end(max_len, q.device)
                kc, vc = kc.masked_fill(past, 0), vc.masked_fill(past, 0)
            mask = self._decode_mask(spec.sliding_window, q.device)
            out = _attend(q.unsqueeze(2), kc.to(q.dtype), vc.to(q.dtype), mask, spec)
            return out.squeeze(2)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, slen) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            nb = -(-slen // md.block_size)
            kc, vc = self._gather(cache, md.block_tables[i : i + 1, :nb], slen)
            q_pos = torch.arange(slen - qlen, slen, device=q.device).unsqueeze(0)
            kv_pos = torch.arange(slen, device=q.device)
            seq = torch.tensor([slen], device=q.device)
            mask = _window_mask(q_pos, kv_pos, seq, spec.sliding_window)
            qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
            oi = _attend(qi, kc.to(q.dtype), vc.to(q.dtype), mask, spec)
            out[start : start + qlen] = oi.squeeze(0).transpose(0, 1)
            start += qlen
        return out
