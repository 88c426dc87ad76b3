"""Fp8Linear: a linear layer whose weight is FP8 E4M3 with one float32 scale per output row.

Its parameters are what the model's weight buffer holds (1 byte a weight, 4 a row): `weight`
[N, K] float8_e4m3fn, `weight_scale` [N] float32, `bias` [N] in the compute dtype or None. The
matmul is one function, `fp8_linear`, which takes one of two paths:

- `fp8_scaled_mm`: the activations quantized to E4M3 per token (a row's amax / 448, float32
  scales [T, 1]) and torch._scaled_mm's FP8 GEMM with row-wise scales on both sides: the
  tensor cores' FP8 rate, the weight read once at 1 byte a value. A layer takes it for steps
  of at least `scaled_mm_min_rows` rows, set by `use_scaled_mm` where it runs (a CUDA device
  of compute capability 8.9 or more, bf16, K and N multiples of 16); for steps of at most
  `swap_max_rows` rows with the operands swapped (y.T = W @ x.T: the GEMM's tall tiles over
  the weight's rows, not over a few tokens);
- the dequantized weight: exact (every E4M3 value is a bf16/fp16/fp32 value) and slow on a
  GPU (the weight read, a bf16 copy written and read again); every other step, and always
  off a GPU.

Small decode steps on a GPU run neither: their graphs' Triton GEMVs and small GEMMs read the
FP8 weight as it is (models.kernels.fused_decode).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import fp8_quant
from models.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_AMAX
from models.kernels.triton_ops import triton_runs_on


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    scaled_mm_min_rows: int | None = None,
    swap_max_rows: int = 0,
) -> torch.Tensor:
    """x [T, K] (compute dtype) @ (weight [N, K] fp8 * scale [N, 1]).T (+ bias) -> [T, N] in x's
    dtype: `fp8_scaled_mm` for at least scaled_mm_min_rows rows of bf16 (the caller knows it
    runs: `scaled_mm_takes`; its operands swapped for at most swap_max_rows rows), else the
    dequantized weight's linear."""
    rows = x.shape[0]
    if scaled_mm_min_rows is not None and rows >= scaled_mm_min_rows and x.dtype == torch.bfloat16:
        return fp8_scaled_mm(x, weight, scale, bias, swap=rows <= swap_max_rows)
    return fp8_dequant_linear(x, weight, scale, bias)


def fp8_dequant_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp8_linear through the weight dequantized to x's dtype: the per-row scale applied to the
    output columns (y[:, n] = (x @ q[n]) * s[n])."""
    y = F.linear(x, weight.to(x.dtype))
    y.mul_(scale)  # computed in float32, stored in x's dtype
    if bias is not None:
        y.add_(bias)
    return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] float8_e4m3fn, scale [T, 1] float32), x ~= xq * scale: each row
    (token) scaled by its amax / 448, so that its largest value lands on 448."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)  # exact, x's dtype
    # times the reciprocal, not divided: torch's CUDA division by a scalar is this product, its
    # CPU one a true division; written out, both devices (and the fused kernel) agree bit for bit
    s = amax.float().clamp_(min=MIN_AMAX) * (1.0 / FP8_MAX)
    # NOTE: |x / s| <= 448 up to fp32's rounding, which rounds to 448 in E4M3: no clamp
    return (x / s).to(FP8_DTYPE), s


def fp8_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    swap: bool = False,
) -> torch.Tensor:
    """fp8_linear through torch._scaled_mm: x quantized per token (`quantize_rows`), the FP8
    product summed in fp32 and scaled by both rows' scales, the bias added, in x's dtype. A
    token's rounding adds at most 2**-4 of each |x| (E4M3's step) to the dequantized path's
    error. On a GPU: bf16 x, K and N multiples of 16 (`scaled_mm_takes`).

    swap: computed as y.T = weight @ xq.T, the weight's N rows the GEMM's M side (the side its
    tiles are tall on) and the few tokens, padded to a multiple of 16, the narrow side; the
    same products and sums in another order."""
    # on a GPU one Triton kernel, elsewhere torch's three passes (the same numerics)
    fused = x.is_cuda and x.stride(1) == 1 and triton_runs_on(x.device)
    xq, xs = fp8_quant.quantize_rows(x) if fused else quantize_rows(x)
    if swap:
        return _scaled_mm_swapped(xq, xs, weight, scale, bias, x.dtype)
    # weight.t(): [K, N] column-major, the layout _scaled_mm takes for its second operand
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=scale[None, :], bias=bias, out_dtype=x.dtype
    )


def _scaled_mm_swapped(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_scaled_mm's product with the operands swapped: [T, N] in dtype, contiguous."""
    t = xq.shape[0]
    pad = -t % 16  # _scaled_mm's dimensions are multiples of 16
    if pad:  # zero tokens (E4M3's zero byte), scale 1
        xq = torch.cat([xq.view(torch.uint8), xq.new_zeros(pad, xq.shape[1], dtype=torch.uint8)])
        xq, xs = xq.view(FP8_DTYPE), torch.cat([xs, xs.new_ones(pad, 1)])
    # xq.t(): [K, T] column-major (the second operand's layout); scales [N, 1] and [1, T]
    yt = torch._scaled_mm(
        weight, xq.t(), scale_a=scale[:, None], scale_b=xs.reshape(1, -1), out_dtype=dtype
    )
    y = yt[:, :t].t().contiguous()
    return y if bias is None else y.add_(bias)


@functools.cache
def scaled_mm_runs(device: torch.device) -> bool:
    """Whether `device` runs torch._scaled_mm with row-wise scales: CUDA of compute capability
    8.9 (Ada) or more, asked once a device."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_takes(layer: Fp8Linear, runs: bool) -> bool:
    """Whether a layer's matmul can run fp8_scaled_mm where it `runs` (scaled_mm_runs): a bf16
    layer (the row-wise kernels' output) of K and N multiples of 16 (_scaled_mm's operands)."""
    n, k = layer.weight.shape
    return runs and layer.compute_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def use_scaled_mm(
    model: nn.Module, device: torch.device, min_rows: int | None, swap_max_rows: int = 0
) -> int:
    """Sets each Fp8Linear of model on `device` to run fp8_scaled_mm for steps of at least
    min_rows rows (None: never) where it can (`scaled_mm_takes`), its operands swapped for
    steps of at most swap_max_rows rows, the dequantized path otherwise; the layers that take
    it. Decided once here, so that a step asks no device."""
    runs = min_rows is not None and scaled_mm_runs(device)
    taken = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.scaled_mm_min_rows = min_rows if scaled_mm_takes(m, runs) else None
            m.swap_max_rows = swap_max_rows
            taken += m.scaled_mm_min_rows is not None
    return taken


class Fp8Linear(nn.Module):
    """An FP8 linear of `in_features` -> `out_features`; `shards` (HF projection name -> rows,
    in stacking order) when it is a merged projection (q/k/v, gate/up): the loader writes each
    HF tensor (and its scale) into shard_rows(shard). scaled_mm_min_rows: the fewest rows of a
    step that runs torch._scaled_mm (None: none; `use_scaled_mm` sets it), swap_max_rows the
    most rows of a step that runs it with its operands swapped."""

    scaled_mm_min_rows: int | None = None
    swap_max_rows: int = 0

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
        return fp8_linear(
            x, self.weight, self.weight_scale, self.bias, self.scaled_mm_min_rows,
            self.swap_max_rows,
        )  # fmt: skip

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"
        s += f", bias={self.bias is not None}"
        return s + (f", shards={self.shards}" if self.shards else "")
