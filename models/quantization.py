"""FP8 weights: E4M3 values with one float32 scale per output channel (row).

    q, scale = quantize_fp8(w)          # w [N, K] -> q [N, K] float8_e4m3fn, scale [N] float32
    w ~= dequantize_fp8(q, scale, dtype)  # q * scale[:, None]; relative error <= 2**-4 a value
    quantize_model(model)               # every projection of a meta-built model -> Fp8Linear
    checkpoint_fp8(config_json)         # does config.json say the weights already are FP8?
    checkpoint_block(config_json)       # the blocks of its weight scales (None: per row/tensor)
    per_channel(tensors, block)         # a block-scaled checkpoint's tensors, requantized by row

A scale is the row's amax times 1 / 448 (448: E4M3's largest finite value), so every value of
the row is representable and the largest lands on 448. Embeddings and the LM head are never
quantized. A checkpoint with block-wise scales (e.g. 128 x 128, as Qwen3's and DeepSeek's FP8
releases) is requantized per row at load: each weight dequantized with its blocks' scales,
then quantized as above (a second rounding: at most 2**-4 of a value more; in perplexity about
one more per-row quantization, docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from models.layers.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear

QUANTIZATIONS = ("fp8",)  # the values of ModelSpec.quantization (None: the compute dtype)
# elements of a row chunk's float32 temporary while quantizing (bounds the transient memory)
_CHUNK_ELEMENTS = 1 << 26


def check_quantization(quantization: str | None) -> None:
    """A clear error for a value other than None or one of QUANTIZATIONS."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        allowed = ", ".join(repr(q) for q in QUANTIZATIONS)
        raise ValueError(f"quantization must be one of {allowed} (or unset), got {quantization!r}")


@torch.no_grad()
def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N] float32), on w's device,
    with w ~= q * scale[:, None]. An all-zero row gets scale 1 (its values stay 0)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 takes a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1]))
    for lo in range(0, w.shape[0], step):
        rows = w[lo : lo + step].float()  # [n, K]
        s = rows.abs().amax(dim=1) * (1.0 / FP8_MAX)  # as the activations (every device alike)
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[lo : lo + step] = (rows / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[lo : lo + step] = s
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] float8_e4m3fn, scale [N] float32 -> q * scale[:, None] in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def expand_scale(scale: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A checkpoint's weight scale -> one float32 scale per output row [rows]: a per-tensor
    scale ([], [1] or [1, 1]) is repeated; a per-channel one ([rows] or [rows, 1]) kept."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows)
    if s.numel() == rows and (scale.dim() == 1 or tuple(scale.shape) == (rows, 1)):
        return s
    raise ValueError(
        f"{what}: weight scale of shape {tuple(scale.shape)} is neither per-tensor nor "
        f"per-output-channel of {rows} rows (block-wise scales: config.json must name their blocks)"
    )


def quantize_model(model: nn.Module) -> nn.Module:
    """Every nn.Linear of the decoder stack (q/k/v merged, o, gate/up merged, down; a merged one
    stays one module) becomes an Fp8Linear of its shape; the embeddings and lm_head stay. Made
    for a model on the meta device: the new modules' parameters are empty (filled at load)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head" or not name:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Fp8Linear.like(module))
    return model


# ---------------------------------------------------------------- checkpoints already in FP8


def checkpoint_fp8(hf_config: dict) -> bool:
    """Whether config.json's quantization_config says the weights are FP8 E4M3 with per-tensor
    or per-channel scales: vLLM's `fp8` method, or `compressed-tensors` float-quantized weights
    of 8 bits. No quantization_config: False. Any other scheme: a ValueError saying which."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return False
    if not isinstance(qc, dict):
        raise ValueError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        checkpoint_block(hf_config)  # a block size that is one
        return True
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return True
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported; FP8 checkpoints load "
        "in vLLM's 'fp8' or the 'compressed-tensors' float-quantized layout"
    )


def checkpoint_block(hf_config: dict) -> tuple[int, int] | None:
    """The [rows, columns] of the weight scales' blocks of a block-wise FP8 checkpoint (vLLM's
    `fp8` with weight_block_size, compressed-tensors' `block` strategy with block_structure);
    None for per-tensor or per-channel scales. A ValueError for a block that is not two
    positive integers."""
    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
    else:
        groups = (qc.get("config_groups") or {}).values()
        block = next(
            (g["weights"].get("block_structure") for g in groups
             if ((g or {}).get("weights") or {}).get("strategy") == "block"),
            None,
        )  # fmt: skip
    if block is None:
        return None
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config: FP8 weight blocks {block!r} are not [rows, cols]")
    return int(block[0]), int(block[1])


def per_channel(
    tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-wise FP8 checkpoint's (name, tensor) pairs as a per-channel one's: each FP8
    `X.weight` [N, K] with its block scales (`X.weight_scale_inv` or `X.weight_scale`,
    [ceil(N / rows), ceil(K / cols)], w = q * scale by block) becomes `X.weight` requantized
    by row and `X.weight_scale` [N]; the other tensors pass as they are. A weight or scale
    whose partner never comes, or scales of the wrong shape: a ValueError naming it."""
    weights: dict[str, torch.Tensor] = {}  # prefix -> an FP8 weight waiting for its scales
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # prefix -> (name, block scales)
    for name, t in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dtype == FP8_DTYPE:
            weights[prefix] = t
        elif leaf in ("weight_scale_inv", "weight_scale") and t.dim() == 2:
            scales[prefix] = (name, t)
        else:
            yield name, t
            continue
        if prefix in weights and prefix in scales:
            q, (sname, s) = weights.pop(prefix), scales.pop(prefix)
            yield from zip((f"{prefix}.weight", f"{prefix}.weight_scale"),
                           requantize_blocks(q, s, block, sname))  # fmt: skip
    if weights:
        prefix = next(iter(weights))
        raise ValueError(f"{prefix}.weight: an FP8 weight with no block scales in the checkpoint")
    if scales:
        name = next(iter(scales.values()))[0]
        raise ValueError(f"{name}: block scales with no FP8 weight in the checkpoint")


@torch.no_grad()
def requantize_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], what: str = "weight scale"
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight q [N, K] with scales by block (scale [ceil(N / rows), ceil(K / cols)]) ->
    quantize_fp8 of its dequantized values: (q [N, K] float8_e4m3fn, scale [N] float32)."""
    (n, k), (rows, cols) = q.shape, block
    want = (-(-n // rows), -(-k // cols))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{what}: block scales of shape {tuple(scale.shape)}, want {want} for a weight of "
            f"[{n} x {k}] in blocks of [{rows} x {cols}]"
        )
    out = torch.empty_like(q)
    row_scale = torch.empty(n, dtype=torch.float32, device=q.device)
    s = scale.float().repeat_interleave(cols, dim=1)[:, :k]  # [N / rows, K]
    for i, lo in enumerate(range(0, n, rows)):  # a row of blocks at a time (bounded memory)
        w = q[lo : lo + rows].float() * s[i]
        out[lo : lo + rows], row_scale[lo : lo + rows] = quantize_fp8(w)
    return out, row_scale


def _check_compressed_tensors(qc: dict) -> None:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config (compressed-tensors): no config_groups")
    for gname, group in groups.items():
        w = (group or {}).get("weights") or {}
        kind = (w.get("type"), w.get("num_bits"), w.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel", "block"):
            raise ValueError(
                f"quantization_config (compressed-tensors) group {gname!r}: weights of type "
                f"{kind[0]!r}, {kind[1]} bits, strategy {kind[2]!r} are not supported; FP8 "
                "(type float, 8 bits) with tensor, channel or block strategy only"
            )
        if w.get("symmetric") is False:
            raise ValueError(
                f"quantization_config (compressed-tensors) group {gname!r}: asymmetric FP8 "
                "weights (zero points) are not supported"
            )
