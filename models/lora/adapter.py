"""Reading a LoRA adapter in the PEFT format (adapter_config.json + adapter_model.safetensors,
or adapter_model.bin) and validating it against the base model it is to run on.

PEFT names a tensor `base_model.model.<module path>.lora_A.weight` ([r, in]) or `.lora_B.weight`
([out, r]); the module path is the base's HF name (model.layers.3.self_attn.q_proj). A module's
scaling is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern override r and lora_alpha for the modules whose path their keys match (PEFT's
get_pattern_key). Reference: peft/tuners/lora/{config,layer}.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from models.lora.weights import (
    SUPPORTED_TARGETS,
    LoraAdapter,
    LoraModule,
    LoraShard,
    LoraTarget,
    LoraWeights,
    lora_targets,
)

DEFAULT_MAX_RANK = 64
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
# config keys whose (truthy) value asks for something Prism does not run
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "target_parameters": "LoRA on parameters (target_parameters)",
}
_NOT_LINEAR = ("embed_tokens", "lm_head")  # targets PEFT allows that Prism does not adapt


class AdapterError(ValueError):
    """An adapter Prism cannot run on its base: the message names the adapter and the problem."""


def read_adapter(
    path: str | Path,
    base: nn.Module,
    max_rank: int = DEFAULT_MAX_RANK,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """The adapter in directory `path`, checked against `base` (Prism's model: its projections'
    shapes) and `max_rank`; its tensors on the host in `dtype` (default: the base's), scaling
    folded into B. name: the adapter's name in errors (default: the directory's). Raises
    AdapterError naming the problem."""
    path = Path(path).expanduser()
    name = name or path.name
    if not isinstance(base, nn.Module):  # (models.tensor_parallel.TensorParallel)
        raise AdapterError(
            f"adapter {name}: its base is split over devices (tensor parallelism), which "
            "adapters do not run on"
        )
    config = read_adapter_config(path, name)
    targets = lora_targets(base)
    _check_config(config, name, max_rank, targets)
    tensors = _read_tensors(path, name)
    dtype = dtype or activation_dtype(base)
    pairs = _pairs(tensors, name, targets, base)
    use_rslora = bool(config.get("use_rslora", False))
    alpha, alpha_pattern = config.get("lora_alpha", 8), config.get("alpha_pattern") or {}
    modules: dict[str, list[tuple[LoraTarget, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for hf_path, (a, b) in pairs.items():
        target = targets[hf_path]
        r = _check_shapes(name, hf_path, target, a, b, max_rank)
        key = _pattern_key(alpha_pattern, hf_path)
        module_alpha = alpha_pattern[key] if key is not None else alpha
        scaling = module_alpha / (math.sqrt(r) if use_rslora else r)
        b = (b.to(torch.float32) * scaling).to(dtype)
        modules.setdefault(target.module, []).append((target, a.to(dtype), b))
        rank = max(rank, r)
    weights = LoraWeights({m: _module(entries) for m, entries in sorted(modules.items())})
    present = {t.shard for t in (targets[p] for p in pairs)}
    return LoraAdapter(
        name=name,
        path=path,
        rank=rank,
        targets=tuple(t for t in SUPPORTED_TARGETS if t in present),
        weights=weights,
    )


def activation_dtype(base: nn.Module) -> torch.dtype:
    """The dtype of the base's activations: its first parameter of a 16 or 32-bit float type
    (the embedding's; quantized projections have others)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return next((p.dtype for p in base.parameters() if p.dtype in floats), torch.float32)


def read_adapter_config(path: str | Path, name: str) -> dict:
    """The adapter_config.json of the adapter in directory `path`, as a dict; AdapterError
    naming the problem (no such directory, no config, not a JSON object)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterError(f"adapter {name}: {path} is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter {name}: {path} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name}: {file} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name}: {file} is not a JSON object")
    return config


def _check_config(config: dict, name: str, max_rank: int, targets: dict[str, LoraTarget]):
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {peft_type!r} is not LoRA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"adapter {name}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"adapter {name}: bias {bias!r} is not supported (only 'none')")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    for r in ranks:
        if not isinstance(r, int) or r < 1:
            raise AdapterError(f"adapter {name}: rank {r!r} is not a positive integer")
        if r > max_rank:
            raise AdapterError(f"adapter {name}: rank {r} exceeds the maximum rank {max_rank}")
    alphas = [config.get("lora_alpha", 8), *(config.get("alpha_pattern") or {}).values()]
    for alpha in alphas:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise AdapterError(f"adapter {name}: lora_alpha {alpha!r} is not a number")
    modules = config.get("target_modules")
    if isinstance(modules, list):  # (a string is a regex, or all-linear: the tensors tell)
        for m in modules:
            _check_target(name, str(m).rpartition(".")[2], targets)


def _check_target(name: str, leaf: str, targets: dict[str, LoraTarget]) -> None:
    """Raises unless `leaf` is a projection Prism adapts on this base."""
    supported = ", ".join(SUPPORTED_TARGETS)
    if leaf in _NOT_LINEAR:
        raise AdapterError(
            f"adapter {name}: target module {leaf!r} is not supported (supported: {supported})"
        )
    if leaf not in {t.shard for t in targets.values()}:
        raise AdapterError(
            f"adapter {name}: unknown target module {leaf!r}: the base has no such projection "
            f"(supported: {supported})"
        )


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    for fname in WEIGHT_FILES:
        file = path / fname
        if not file.is_file():
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (any unreadable file: say which)
            raise AdapterError(f"adapter {name}: cannot read {file} ({e})") from e
    raise AdapterError(f"adapter {name}: {path} has no {' or '.join(WEIGHT_FILES)}")


def _pairs(
    tensors: dict[str, torch.Tensor], name: str, targets: dict[str, LoraTarget], base: nn.Module
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module path -> its (A, B), every tensor accounted for."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        rest = key.removeprefix(_PREFIX)
        if "lora_magnitude_vector" in rest:
            raise AdapterError(f"adapter {name}: DoRA (use_dora) is not supported")
        for part in rest.split("."):  # (lora_embedding_A, a saved lm_head.base_layer, ...)
            if part in _NOT_LINEAR:
                _check_target(name, part, targets)
        m = _TENSOR.fullmatch(rest)
        if m is None:
            raise AdapterError(f"adapter {name}: tensor {key!r} is not a LoRA A or B weight")
        hf_path = _rename(base, m["module"])
        leaf = m["module"].rpartition(".")[2]
        _check_target(name, leaf, targets)
        if hf_path not in targets:
            raise AdapterError(
                f"adapter {name}: the base has no {m['module']} (an adapter of another model?)"
            )
        found.setdefault(hf_path, {})[m["which"]] = t
    if not found:
        raise AdapterError(f"adapter {name}: no LoRA tensors")
    for hf_path, ab in found.items():
        for which in "AB":
            if which not in ab:
                raise AdapterError(f"adapter {name}: {hf_path} has no lora_{which} weight")
    return {p: (ab["A"], ab["B"]) for p, ab in sorted(found.items())}


def _rename(base: nn.Module, module: str) -> str:
    """A PEFT module path -> the base's HF path of it (a multimodal checkpoint's prefixes
    dropped by the base's own hf_name)."""
    hf_name = getattr(base, "hf_name", None)
    if hf_name is None:
        return module
    renamed = hf_name(f"{module}.weight")
    return module if renamed is None else renamed.removesuffix(".weight")


def _check_shapes(
    name: str, hf_path: str, target: LoraTarget, a: torch.Tensor, b: torch.Tensor, max_rank: int
) -> int:
    """The module's rank, after checking A [r, in] and B [out, r] against the base's shapes."""
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(f"adapter {name}: {hf_path}'s lora_A and lora_B are not matrices")
    r = a.shape[0]
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
        raise AdapterError(
            f"adapter {name}: {hf_path} is [{b.shape[0]} x {a.shape[1]}] (lora_B rows x lora_A "
            f"columns) but the base's is [{target.out_features} x {target.in_features}] (an "
            "adapter of another model?)"
        )
    if b.shape[1] != r:
        raise AdapterError(
            f"adapter {name}: {hf_path}'s lora_A has rank {r}, its lora_B {b.shape[1]}"
        )
    if r > max_rank:
        raise AdapterError(f"adapter {name}: rank {r} exceeds the maximum rank {max_rank}")
    return r


def _pattern_key(pattern: dict, hf_path: str) -> str | None:
    """The first key of an alpha_pattern matching a module's path, as PEFT matches them."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", hf_path):
            return key
    return None


def _module(entries: list[tuple[LoraTarget, torch.Tensor, torch.Tensor]]) -> LoraModule:
    """One module's shards (in its rows' order): A's stacked, each B at its ranks."""
    entries = sorted(entries, key=lambda e: e[0].rows.start)
    shards, start = [], 0
    for target, a, b in entries:
        r = a.shape[0]
        shards.append(LoraShard(target.shard, target.rows, slice(start, start + r), b))
        start += r
    a = torch.cat([a for _, a, _ in entries]) if len(entries) > 1 else entries[0][1]
    return LoraModule(a.contiguous(), tuple(shards))
