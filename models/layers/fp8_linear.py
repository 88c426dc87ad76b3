"""Fp8Linear: a linear layer whose weight is FP8 E4M3 with one float32 scale per output row.

Its parameters are what the model's weight buffer holds (1 byte a weight, 4 a row): `weight`
[N, K] float8_e4m3fn, `weight_scale` [N] float32, `bias` [N] in the compute dtype or None. The
matmul is one function, `fp8_linear`, the place where an FP8 GEMM kernel takes over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, K] (compute dtype) @ (weight [N, K] fp8 * scale [N, 1]).T (+ bias) -> [T, N] in x's
    dtype. Dequantizes the weight to x's dtype (exact: every E4M3 value is a bf16/fp16/fp32
    value) and applies the per-row scale to the output columns (y[:, n] = (x @ q[n]) * s[n])."""
    # NOTE: the one seam for FP8 kernels (torch._scaled_mm with per-token activation scales,
    # FP8 GEMV for decode): on any other device this is correct and slower than bf16.
    y = F.linear(x, weight.to(x.dtype))
    y.mul_(scale)  # computed in float32, stored in x's dtype
    if bias is not None:
        y.add_(bias)
    return y


class Fp8Linear(nn.Module):
    """An FP8 linear of `in_features` -> `out_features`; `shards` (HF projection name -> rows,
    in stacking order) when it is a merged projection (q/k/v, gate/up): the loader writes each
    HF tensor (and its scale) into shard_rows(shard)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        shards: dict[str, int] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype  # of its inputs, outputs and bias
        self.shards = dict(shards) if shards else None
        if self.shards is not None and sum(self.shards.values()) != out_features:
            raise ValueError(f"shards {self.shards} do not add up to {out_features} rows")
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, dtype=torch.float32), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An Fp8Linear of linear's shape, bias, compute dtype and shards (a MergedLinear's), on
        the current default device (meta while a model is built)."""
        shards = getattr(linear, "shards", None)
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            linear.weight.dtype,
            shards,
        )

    def shard_rows(self, shard: str) -> slice:
        if self.shards is None:
            raise KeyError(shard)
        start = 0
        for name, rows in self.shards.items():
            if name == shard:
                return slice(start, start + rows)
            start += rows
        raise KeyError(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"
        s += f", bias={self.bias is not None}"
        return s + (f", shards={self.shards}" if self.shards else "")
