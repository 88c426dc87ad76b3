"""load_hf_weights: copy HF-named tensors into a model built from models/layers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from models.layers.merged_linear import MergedLinear


def _shard_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, slice]]:
    """HF name of each stacked projection's tensor -> (fused parameter, its rows)."""
    targets = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MergedLinear):
            parent = mod_name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            for shard in mod.shards:
                for pname, param in mod.named_parameters(recurse=False):
                    targets[f"{prefix}{shard}.{pname}"] = (param, mod.shard_rows(shard))
    return targets


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Copy (HF name, tensor) pairs into `model`'s parameters, casting to each parameter's dtype
    and device. q/k/v and gate/up land in their MergedLinear's rows.

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
    loaded: set[str] = set()
    for name, tensor in weights:
        name = rename(name)
        if name is None or name.endswith("rotary_emb.inv_freq") or name in tied:
            continue
        if name in shards:
            param, rows = shards[name]
            dst = param[rows]
        elif name in params:
            dst = params[name]
        else:
            raise ValueError(f"unknown parameter {name!r} for {type(model).__name__}")
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        loaded.add(name)
    missing = (set(params) | set(shards)) - loaded
    if missing:
        raise ValueError(f"parameters missing from the checkpoint: {sorted(missing)}")
