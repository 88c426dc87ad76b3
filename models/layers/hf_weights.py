"""load_hf_weights: copy HF-named tensors into a model built from models/layers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from models.layers.fp8_linear import FP8_DTYPE, Fp8Linear
from models.layers.merged_linear import MergedLinear
from models.quantization import expand_scale, quantize_fp8

# checkpoint tensors of FP8 layouts that Prism does not use: static activation scales and FP8
# KV cache scales (its activations are scaled per token, its KV cache is in the compute dtype)
_UNUSED_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale", ".q_scale")


def _shard_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, slice]]:
    """HF name of each stacked projection's tensor -> (fused parameter, its rows)."""
    targets = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MergedLinear | Fp8Linear) and mod.shards:
            parent = mod_name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            for shard in mod.shards:
                for pname, param in mod.named_parameters(recurse=False):
                    targets[f"{prefix}{shard}.{pname}"] = (param, mod.shard_rows(shard))
    return targets


def _fp8_weights(model: nn.Module) -> dict[str, str]:
    """HF name of each FP8 weight (a merged projection's shards by their own names) -> the HF
    name of its scale."""
    names = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            parent = mod_name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            for part in mod.shards or [mod_name.rpartition(".")[2]]:
                names[f"{prefix}{part}.weight"] = f"{prefix}{part}.weight_scale"
    return names


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Copy (HF name, tensor) pairs into `model`'s parameters, casting to each parameter's dtype
    and device. q/k/v and gate/up land in their MergedLinear's rows.

    An Fp8Linear's weight takes an FP8 tensor as it is (its `weight_scale`, per-tensor or per
    output channel, comes beside it) or a float tensor, quantized here per output channel (its
    scale made with it; a checkpoint scale for it is then ignored).

    rename maps a checkpoint name to the model's HF-style name, or None to skip it. Rotary
    inv_freq buffers are skipped; a tied lm_head (sharing the embedding Parameter) is skipped.
    Raises ValueError on an unknown name, a shape mismatch, or parameters left unloaded.
    """
    shards = _shard_targets(model)
    fused = {id(param) for param, _ in shards.values()}
    params = {n: p for n, p in model.named_parameters() if id(p) not in fused}  # deduplicated
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(
        dict(model.named_parameters())
    )
    fp8 = _fp8_weights(model)
    quantized: set[str] = set()  # scales made here, from float weights
    loaded: set[str] = set()
    for name, tensor in weights:
        name = rename(name)
        if name is None or name.endswith("rotary_emb.inv_freq") or name in tied:
            continue
        if name.endswith(_UNUSED_SCALES):
            continue
        if name in shards:
            param, rows = shards[name]
            dst = param[rows]
        elif name in params:
            dst = params[name]
        else:
            raise ValueError(f"unknown parameter {name!r} for {type(model).__name__}")
        if name.endswith(".weight_scale"):
            if name not in quantized:
                dst.copy_(expand_scale(tensor, dst.shape[0], name))
                loaded.add(name)
            continue
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(dst.shape)}"
            )
        if tensor.dtype == FP8_DTYPE and dst.dtype != FP8_DTYPE:
            raise ValueError(
                f"{name}: the checkpoint holds FP8 weights; serve it with quantization = 'fp8' "
                "(embeddings and the LM head must not be FP8)"
            )
        if name in fp8 and tensor.dtype != FP8_DTYPE:  # a float weight: quantized here
            q, scale = quantize_fp8(tensor.to(dst.device))
            dst.copy_(q)
            scale_name = fp8[name]
            scale_dst = shards[scale_name] if scale_name in shards else (params[scale_name], None)
            param, rows = scale_dst
            (param if rows is None else param[rows]).copy_(scale)
            quantized.add(scale_name)
            loaded.add(scale_name)
        else:
            dst.copy_(tensor)
        loaded.add(name)
    missing = (set(params) | set(shards)) - loaded
    if missing:
        raise ValueError(f"parameters missing from the checkpoint: {sorted(missing)}")
