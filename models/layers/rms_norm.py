"""RMSNorm, in HF's two numerics: Llama's (scale after casting back) and Gemma's (1 + w)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.fused_ops import add_rms_norm, fused, rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * w over the last dim, statistics in fp32.

    unit_offset=True is Gemma's variant: the weight is stored centred on 0 and applied as (1 + w),
    in fp32 before the cast back; otherwise (Llama, Qwen) x is cast back first, then scaled by w.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if x.dtype == torch.float32 and not self.unit_offset:  # one fused op, same numerics
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        fi = fused(x)
        if fi is not None:
            return rms_norm(fi, x, self.weight, self.eps, self.unit_offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream's add and the next norm, one
        kernel where FlashInfer's applies (it overwrites x and residual); x, residual [T, dim]."""
        fi = fused(x) if not self.unit_offset else None
        if fi is not None and x.is_contiguous() and residual.is_contiguous():
            add_rms_norm(fi, x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"
