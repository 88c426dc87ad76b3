"""GatedMLP: down(act(gate(x)) * up(x)) with gate and up fused into one projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention.base import ForwardContext
from models.layers.fused_ops import act_and_mul, fused
from models.layers.merged_linear import MergedLinear


class GatedMLP(nn.Module):
    """SwiGLU (act="silu") or GeGLU (act="gelu_pytorch_tanh"); HF names gate/up/down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {act!r}")
        self.act = act
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        def proj(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            return module(x) if ctx is None else ctx.linear(module, x)

        gate_up = proj(self.gate_up_proj, x)  # [T, 2 * intermediate]
        fi = fused(gate_up)
        if fi is not None:
            return proj(self.down_proj, act_and_mul(fi, gate_up, self.act))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return proj(self.down_proj, gate * up)
