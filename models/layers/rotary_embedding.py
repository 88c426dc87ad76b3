"""Rotary position embedding (GPT-NeoX / HF "rotate_half" layout), plain, linear or llama3-scaled.

cos/sin are computed once per step from the positions (`RotaryEmbedding.forward`) and shared by
every layer that uses the same rope (`Rope`); each attention layer then calls `Rope.apply`. On CUDA
that is one FlashInfer kernel rotating q and k in place, reading this step's fp32 table (rows
0..T-1: no table of every position per model); elsewhere `apply_rotary`, HF's arithmetic, with
cos/sin cast to the model's dtype once per step rather than once per layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.layers.fused_ops import fused


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS give them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones, blend in between
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, 1, head_dim] in fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(bf16) / to_empty() would cast or wipe inv_freq; recompute it in fp32
        # on whatever device the module now lives on.
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        if device.type != "meta":
            self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        return self

    def forward(self, positions: torch.Tensor) -> Rope:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, head_dim // 2]
        return Rope(freqs.cos(), freqs.sin())

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] -> [T, H, D] (cos/sin cast to x's dtype, as HF does)."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Rope:
    """One step's rotary table: cos and sin of each token's angles, [T, head_dim // 2] fp32."""

    def __init__(self, cos_half: torch.Tensor, sin_half: torch.Tensor):
        self.cos_half, self.sin_half = cos_half, sin_half
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table: torch.Tensor | None = None
        self._rows_: torch.Tensor | None = None

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim] in `dtype` (HF's: computed in fp32, then cast)."""
        if dtype not in self._cast:
            emb = (torch.cat((h, h), dim=-1).unsqueeze(1) for h in (self.cos_half, self.sin_half))
            self._cast[dtype] = tuple(e.to(dtype) for e in emb)
        return self._cast[dtype]

    def table(self) -> torch.Tensor:
        """[T, head_dim] fp32: each token's cos half, then its sin half (what the rope kernels
        read; fp32, which FlashInfer's reads without checking)."""
        if self._table is None:
            self._table = torch.cat((self.cos_half, self.sin_half), dim=-1).float().contiguous()
        return self._table

    def _rows(self) -> torch.Tensor:
        if self._rows_ is None:
            t = self.cos_half.shape[0]
            self._rows_ = torch.arange(t, dtype=torch.int32, device=self.cos_half.device)
        return self._rows_

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, contiguous: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> both rotated: in place where the kernel runs, but q
        into a new contiguous tensor when `contiguous` asks (one kernel either way)."""
        fi = fused(q)
        if fi is None:
            cos, sin = self.cos_sin(q.dtype)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        table, rows = self.table(), self._rows()
        if contiguous and not q.is_contiguous():
            # NOTE: the op behind FlashInfer's two public rope functions, to write q to a new
            # contiguous tensor while k turns where it lies (beside v: one K/V write, no copy)
            q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            fi.rope._apply_rope_pos_ids_cos_sin_cache(q, k, q_out, k, table, rows, False)
            return q_out, k
        fi.rope.apply_rope_with_cos_sin_cache_inplace(rows, q, k, q.shape[-1], table, is_neox=True)
        return q, k
