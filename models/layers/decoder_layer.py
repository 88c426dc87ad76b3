"""DecoderLayer: the pre-norm block shared by Llama, Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.kernels.triton_small_gemm import Normed
from models.layers.gated_mlp import GatedMLP
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import Rope
from models.layers.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). HF names: input_layernorm, self_attn,
    post_attention_layernorm, mlp.

    The residual stream is carried beside the layer's output rather than added at its end: each
    add joins the norm after it (RMSNorm.add, one kernel on CUDA), the last one the model's
    final norm."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | Normed | None,
        rope: Rope,
        ctx: ForwardContext,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | Normed | None]:
        """x: the previous layer's output (the embeddings for the first layer, residual None),
        residual: the stream before it, each [T, hidden] -> (this layer's output, the stream
        before it); the stream after this layer is their sum. A layer of small GEMMs
        (`small_layer`) returns (the stream after it, the next norm's input for the next
        layer: a Normed, or None for the last). next_norm: the next layer's input norm (None
        for the last layer)."""
        ops = ctx.step_ops
        if ops is not None and ops.takes_layer(self, x, ctx.reduce is None):
            if ops.gemv_takes(x):
                return self.gemv_layer(x, residual, rope, ctx, ops)
            return self.small_layer(x, residual, rope, ctx, ops, next_norm)
        if isinstance(residual, Normed):  # (a layer of small GEMMs before: x is the stream)
            residual = None
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = ctx.all_reduce(self.self_attn(h, rope, ctx))
        h, residual = self.post_attention_layernorm.add(h, residual)
        return ctx.all_reduce(self.mlp(h, ctx)), residual

    def gemv_layer(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext, ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's one-row step as four GEMVs around the attention, the norms, the residual's
        adds and the activation inside them (StepOps.project, models.kernels.triton_gemv); the
        same (output, stream before it) pair. The stream's adds write into its tensor (the
        first layer's: the embeddings'), as the unfused path's norms do."""
        h, stream = (None, x) if residual is None else (x, residual)
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        qkv = ops.project(attn.qkv_proj, stream, norm=(ln1.weight, ln1.eps), h=h)
        out = attn.attend(qkv, rope, ctx)
        stream = ops.project(attn.o_proj, out, into=stream, h=h)  # stream (+ h) + o_proj(out)
        if ops.glu:  # the activation out of gate_up's GEMV
            act = ops.project(mlp.gate_up_proj, stream, norm=(ln2.weight, ln2.eps), glu=True)
            return ops.project(mlp.down_proj, act), stream
        gate_up = ops.project(mlp.gate_up_proj, stream, norm=(ln2.weight, ln2.eps))
        return ops.project(mlp.down_proj, gate_up, silu=True), stream

    def small_layer(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | Normed | None,
        rope: Rope,
        ctx: ForwardContext,
        ops,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, Normed | None]:
        """forward's step of a few rows as four small GEMMs around the attention
        (models.kernels.triton_small_gemm): o_proj and down_proj add into the stream and hand
        the next norm its input (the stream's rows scaled by its weight, their squares), qkv
        and gate_up apply the norm to their sums, gate_up makes SiLU * up. The stream is x
        after a layer of small GEMMs (residual: its Normed) or the first layer (residual None:
        the embeddings, written into, as the unfused path's norms do)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        if isinstance(residual, torch.Tensor):  # (a layer of the unfused path before)
            residual = residual.add_(x)
            x, residual = residual, None
        stream = x
        normed = residual if residual is not None else ops.prenorm(stream, ln1.weight, ln1.eps)
        out = attn.attend(ops.project(attn.qkv_proj, normed), rope, ctx)
        normed = ops.project(attn.o_proj, out, into=stream, norm=(ln2.weight, ln2.eps))
        act = ops.project(mlp.gate_up_proj, normed, glu=True)
        nxt = (next_norm.weight, next_norm.eps) if next_norm is not None else None
        return stream, ops.project(mlp.down_proj, act, into=stream, norm=nxt)
