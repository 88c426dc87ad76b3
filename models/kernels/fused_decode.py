"""A small decode step's layers as chains of Triton kernels that carry the norms, activation
and residual adds: one-row steps as GEMVs (models.kernels.triton_gemv), steps of a few rows as
small GEMMs (models.kernels.triton_small_gemm). A decode graph of at most STEP_OPS_MAX_BATCH
sequences runs its model through `forward` where the kernels are built and checked on its
device (`load_step_ops`) and the model is a stack of pre-norm layers (`runs`): the choice is
made once, when the graph is captured; the model files keep their one plain forward.

An FP8 model's projections (E4M3 weights, a float32 scale a row) take the same kernels, their
weights read as they are, where the FP8 kernels were checked on the device too (`fp8`).

The stack's layers are read by their names (HF's: input_layernorm, self_attn.qkv_proj, o_proj,
post_attention_layernorm, mlp.gate_up_proj, down_proj); this module imports no model."""

from __future__ import annotations

import torch

from models.kernels.triton_gemv import GemvConfig, gemv, gemv_reference
from models.kernels.triton_ops import fp8_row_scale, triton_runs_on
from models.kernels.triton_small_gemm import MAX_ROWS as SMALL_MAX_ROWS
from models.kernels.triton_small_gemm import (
    Normed,
    SmallGemmConfig,
    prenorm,
    small_gemm,
    small_gemm_reference,
)
from models.kernels.triton_small_gemm import fits as small_gemm_fits


class StepOps:
    """A small decode step's layers as chains of kernels (ForwardContext's step_ops: decode
    graphs of at most STEP_OPS_MAX_BATCH sequences). gemv: a one-row step's tiling of its GEMVs
    (None: small GEMMs there too); small: the tiling of the small GEMMs of steps of a few rows
    (at most 16; None: cuBLAS's). With GEMVs of two rows a program or more, gate_up's GEMV
    makes SiLU * up from its outputs and the down GEMV is a plain one (`glu`); a tiling of one
    row a program cannot pair a gate row with its up row, and the down GEMV computes the
    activation from gate_up's outputs. fp8: FP8 projections take the GEMVs too (else they
    keep their module); fp8_small: and the small GEMMs (else steps of more than one row keep
    their module: torch._scaled_mm)."""

    def __init__(
        self,
        gemv: GemvConfig | None = None,
        small: SmallGemmConfig | None = None,
        fp8: bool = False,
        fp8_small: bool = False,
    ):
        self.gemv_config, self.small_config = gemv, small
        self.glu = gemv is not None and gemv.block_n >= 2
        self.fp8, self.fp8_small = fp8, fp8_small

    def takes_layer(self, layer: torch.nn.Module, x: torch.Tensor, whole: bool) -> bool:
        """Whether a decoder layer's step runs as a chain of kernels that carry its norms,
        activation and residual adds: GEMVs for one row (`gemv`, gemv_layer), small GEMMs for
        at most MAX_ROWS (`small`, small_layer; one row too where the GEMVs are off). The rows
        contiguous, of a GPU's dtype, a whole model (whole: no shards' sums between the
        projections), SiLU, and the projections row-major linears of x's dtype: nn.Linear's,
        or FP8 ones of that compute dtype where `fp8` (and `fp8_small`, for small GEMMs)."""
        few = 1 <= x.shape[0] <= SMALL_MAX_ROWS and self.small_config is not None
        gemv = self.gemv_takes(x)
        if not (
            (gemv or few)
            and whole
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16)
            and layer.mlp.act == "silu"
        ):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return all(self._takes(p, x.dtype, gemv) for p in projections)

    def _takes(self, linear: torch.nn.Module, dtype: torch.dtype, gemv: bool) -> bool:
        """Whether a projection of inputs of `dtype` runs the kernels (GEMVs where `gemv`): a
        plain linear of that weight dtype, or an FP8 one of that compute dtype (where `fp8`,
        and `fp8_small` for small GEMMs); its weight row-major."""
        if _plain_linear(linear):
            return linear.weight.is_contiguous() and linear.weight.dtype == dtype
        return (
            self.fp8
            and (gemv or self.fp8_small)
            and fp8_row_scale(linear) is not None
            and getattr(linear, "compute_dtype", None) == dtype
            and linear.weight.is_contiguous()
        )

    def gemv_takes(self, x: torch.Tensor) -> bool:
        """Whether a fused layer of x's rows runs as GEMVs (else as small GEMMs)."""
        return x.shape[0] == 1 and self.gemv_config is not None

    def project(self, linear: torch.nn.Linear, x: torch.Tensor | Normed, **ops):
        """A fused layer's projection with the ops beside it: a GEMV for one row where the
        GEMVs are on (triton_gemv.gemv's ops), else a small GEMM (triton_small_gemm's)."""
        if isinstance(x, torch.Tensor) and self.gemv_takes(x):
            return gemv(linear, x, config=self.gemv_config, **ops)
        return small_gemm(linear, x, self.small_config, **ops)

    def prenorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Normed:
        """The first layer's norm input for its small GEMMs (triton_small_gemm.prenorm)."""
        return prenorm(x, weight, eps)

    def linear(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """linear(x): a small GEMM where one takes it (`small`: at most 16 rows, a row-major
        weight of x's dtype, or an FP8 one where `fp8` and `fp8_small`), else the module."""
        fp8 = self.fp8 and self.fp8_small and fp8_row_scale(linear) is not None
        if (
            self.small_config is not None
            and (_plain_linear(linear) or fp8)
            and small_gemm_fits(linear, x)
        ):
            return small_gemm(linear, x, self.small_config)
        return linear(x)


def _plain_linear(module: torch.nn.Module) -> bool:
    """Whether module computes nn.Linear's x @ W.T + b over its own weight (an FP8 linear,
    whose weight is scaled per row, does not)."""
    return (
        isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and getattr(module, "weight_scale", None) is None
    )


def runs(model: torch.nn.Module) -> bool:
    """Whether `forward` can run this causal LM's decoder stack: pre-norm layers of the
    names it reads (Llama, Mistral, Qwen2, Qwen3; the stack says so: `pre_norm_stack`)."""
    return getattr(getattr(model, "model", None), "pre_norm_stack", False)


def forward(model: torch.nn.Module, input_ids, positions, ctx, ops: StepOps) -> torch.Tensor:
    """The decoder stack's forward (the stack's own, as its model file writes it) with each
    layer that `ops` takes as a chain of GEMVs (one row) or small GEMMs (a few rows), the
    others as they are: input_ids, positions [T] -> hidden [T, hidden]. model: the causal LM
    (`runs`); ctx: the step's ForwardContext."""
    stack = model.model
    x, residual = stack.embed_tokens(input_ids), None
    rope = stack.rotary_emb(positions)  # this step's rotary table, shared by every layer
    layers = stack.layers
    for i, layer in enumerate(layers):
        # (a layer with LoRA work runs as it is: its projections through ctx.linear)
        if ops.takes_layer(layer, x, ctx.reduce is None) and not ctx.has_lora(layer):
            if ops.gemv_takes(x):
                x, residual = gemv_layer(layer, x, residual, rope, ctx, ops)
            else:
                nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
                x, residual = small_layer(layer, x, residual, rope, ctx, ops, nxt)
        else:
            if isinstance(residual, Normed):  # (a layer of small GEMMs before: x is the stream)
                residual = None
            x, residual = layer(x, residual, rope, ctx)
    if residual is None or isinstance(residual, Normed):  # (no Normed after the last layer)
        return stack.norm(x)
    return stack.norm.add(x, residual)[0]


def gemv_layer(layer, x: torch.Tensor, residual: torch.Tensor | None, rope, ctx, ops: StepOps):
    """A layer's one-row step as four GEMVs around the attention, the norms, the residual's
    adds and the activation inside them (StepOps.project); the layer's forward's (output,
    stream before it) pair. The stream's adds write into its tensor (the first layer's: the
    embeddings'), as the layer's own norms do."""
    h, stream = (None, x) if residual is None else (x, residual)
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ops.project(attn.qkv_proj, stream, norm=(ln1.weight, ln1.eps), h=h)
    out = attn.attend(qkv, rope, ctx)
    stream = ops.project(attn.o_proj, out, into=stream, h=h)  # stream (+ h) + o_proj(out)
    if ops.glu:  # the activation out of gate_up's GEMV
        act = ops.project(mlp.gate_up_proj, stream, norm=(ln2.weight, ln2.eps), glu=True)
        return ops.project(mlp.down_proj, act), stream
    gate_up = ops.project(mlp.gate_up_proj, stream, norm=(ln2.weight, ln2.eps))
    return ops.project(mlp.down_proj, gate_up, silu=True), stream


def small_layer(
    layer,
    x: torch.Tensor,
    residual: torch.Tensor | Normed | None,
    rope,
    ctx,
    ops: StepOps,
    next_norm,
) -> tuple[torch.Tensor, Normed | None]:
    """A layer's step of a few rows as four small GEMMs around the attention: o_proj and
    down_proj add into the stream and hand the next norm (next_norm: the next layer's input
    norm, None for the last) its input (the stream's rows scaled by its weight, their
    squares), qkv and gate_up apply the norm to their sums, gate_up makes SiLU * up. The
    stream is x after a layer of small GEMMs (residual: its Normed) or the first layer
    (residual None: the embeddings, written into, as the layer's own norms do) -> (the stream
    after the layer, the next norm's input: a Normed, or None for the last)."""
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(residual, torch.Tensor):  # (a layer of the plain forward before)
        residual = residual.add_(x)
        x, residual = residual, None
    stream = x
    normed = residual if residual is not None else ops.prenorm(stream, ln1.weight, ln1.eps)
    out = attn.attend(ops.project(attn.qkv_proj, normed), rope, ctx)
    normed = ops.project(attn.o_proj, out, into=stream, norm=(ln2.weight, ln2.eps))
    act = ops.project(mlp.gate_up_proj, normed, glu=True)
    nxt = (next_norm.weight, next_norm.eps) if next_norm is not None else None
    return stream, ops.project(mlp.down_proj, act, into=stream, norm=nxt)


STEP_OPS_MAX_BATCH = 16  # decode graphs of at most this many sequences take them


def load_step_ops(
    device: torch.device,
    gemv: GemvConfig | None = None,
    small: SmallGemmConfig | None = None,
    fp8_small: bool = False,
) -> tuple[StepOps | None, str | None]:
    """The step kernels for `device`, built and checked there against the torch reference (the
    GEMVs' kinds with `gemv`; the small GEMM's with `small`), or None and why not. FP8
    projections take them where their FP8 checks pass too (`StepOps.fp8`; Triton converts
    E4M3 on compute capability 8.9 and later), the small GEMMs only where `fp8_small`."""
    if gemv is None and small is None:
        return None, "no GEMV or small GEMM tiling"
    if not triton_runs_on(device):
        return None, "Triton does not run here"
    ops = StepOps(gemv, small, fp8_small=fp8_small)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        g = torch.Generator(device=device).manual_seed(0)
        checks = []
        if gemv is not None:
            checks += _gemv_checks(ops, g, device, dtype)
        if small is not None:
            checks += _small_gemm_checks(ops, g, device, dtype)
        for name, out, ref in checks:
            if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"{name} differs from the reference")
    except Exception as e:  # noqa: BLE001 (kernels that do not build or run here: go without)
        return None, f"its kernels failed ({type(e).__name__}: {str(e)[:200]})"
    try:
        ops.fp8 = True
        for name, out, ref in _fp8_checks(ops, g, device, dtype):
            if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"{name} differs from the reference")
    except Exception:  # noqa: BLE001 (no E4M3 here: FP8 layers keep their module)
        ops.fp8 = False
    return ops, None


def check_width(device: torch.device) -> int:
    """The columns of the load-time checks: a model's width on a GPU (4096); 512 under Triton's
    interpreter, where the checks only show that the kernels build and run (a model's width
    took half a minute there)."""
    return 4096 if device.type == "cuda" else 512


def _check_linear(k: int, rows: int, g, device, dtype, bias: bool = False) -> torch.nn.Linear:
    """A linear of k inputs and `rows` outputs for the load-time checks, its outputs of unit
    scale (a bias of torch's initialization)."""
    lin = torch.nn.Linear(k, rows, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows, k, generator=g, device=device) * k**-0.5)
    return lin


def _gemv_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype: torch.dtype):
    """(name, the GEMV's result through ops.project, the reference's) for a norm's, an
    activation's and a residual add's GEMV of `check_width` columns."""
    k = check_width(device)
    lin, sq = (_check_linear(k, rows, g, device, dtype) for rows in (256, k))
    x, h, r = (torch.randn(1, k, generator=g, device=device).to(dtype) for _ in range(3))
    nw = torch.randn(k, generator=g, device=device).to(dtype)
    gu = torch.randn(1, 2 * k, generator=g, device=device).to(dtype)
    norm = (nw, 1e-5)
    checks = [
        ("GEMV after a norm", ops.project(lin, x, norm=norm, h=h),
         gemv_reference(lin, x, norm=norm, h=h)),
        ("GEMV after SiLU * up", ops.project(lin, gu, silu=True),
         gemv_reference(lin, gu, silu=True)),
        ("GEMV into the residual", ops.project(sq, x, into=r.clone(), h=h),
         gemv_reference(sq, x, into=r.clone(), h=h)),
    ]  # fmt: skip
    if ops.glu:
        got = ops.project(lin, x, norm=norm, glu=True)
        checks.append(("GEMV making SiLU * up", got, gemv_reference(lin, x, norm=norm, glu=True)))
    return checks


class _Fp8Check(torch.nn.Module):
    """An FP8 linear for the load-time checks: `linear`'s weight quantized per row as
    models.quantization does (amax / 448), what the kernels read of an FP8 projection."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.float()
        s = w.abs().amax(dim=1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        self.weight = (w / s[:, None]).to(torch.float8_e4m3fn)
        self.weight_scale, self.bias = s, linear.bias
        self.compute_dtype = linear.weight.dtype


def _fp8_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype: torch.dtype):
    """(name, the kernel's result, the reference's) for an FP8 linear of `check_width` columns:
    a GEMV after a norm (with `gemv`), a small GEMM of 5 rows with a bias (with `small`)."""
    k = check_width(device)
    lin = _Fp8Check(_check_linear(k, 256, g, device, dtype, bias=True))
    norm = (torch.randn(k, generator=g, device=device).to(dtype), 1e-5)
    checks = []
    if ops.gemv_config is not None:
        x = torch.randn(1, k, generator=g, device=device).to(dtype)
        checks.append(("FP8 GEMV after a norm", ops.project(lin, x, norm=norm),
                       gemv_reference(lin, x, norm=norm)))  # fmt: skip
    if ops.small_config is not None:
        x = torch.randn(5, k, generator=g, device=device).to(dtype)
        checks.append(("FP8 small GEMM of 5 rows", ops.linear(lin, x),
                       small_gemm_reference(lin, x)))  # fmt: skip
    return checks


def _small_gemm_checks(ops: StepOps, g: torch.Generator, device: torch.device, dtype):
    """(name, the small GEMM's result, the reference's) for 5 and 16 rows of `check_width`
    columns: a plain one with a bias (ops.linear), and a small layer's three kinds (after a
    norm, into the residual handing the next norm its input, making SiLU * up)."""
    k = check_width(device)
    lin, sq = (_check_linear(k, rows, g, device, dtype) for rows in (320, k))
    biased = _check_linear(k, 320, g, device, dtype, bias=True)
    norm = (torch.randn(k, generator=g, device=device).to(dtype), 1e-5)
    checks = []
    for m in (5, 16):
        x, r = (torch.randn(m, k, generator=g, device=device).to(dtype) for _ in range(2))
        c, normed = ops.small_config, prenorm(x, *norm)
        stream, nxt = small_gemm_reference(sq, x, into=r.clone(), norm=norm)
        got = small_gemm(sq, x, c, into=(into := r.clone()), norm=norm)
        checks += [
            (f"small GEMM of {m} rows", ops.linear(biased, x), biased(x)),
            (f"small GEMM of {m} rows after a norm", small_gemm(lin, normed, c),
             small_gemm_reference(lin, x, pre=norm)),
            (f"small GEMM of {m} rows into the residual", into, stream),
            (f"the next norm's rows out of {m} rows' residual add", got.rows, nxt),
            (f"small GEMM of {m} rows making SiLU * up", small_gemm(lin, normed, c, glu=True),
             small_gemm_reference(lin, x, pre=norm, glu=True)),
        ]  # fmt: skip
    return checks
