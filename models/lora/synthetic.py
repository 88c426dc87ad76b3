"""Synthetic LoRA adapters for a dummy base: the benchmarks' fine-tunes.

    python -m prism_server make-adapters --preset llama-3.1-8b --names 'ft{000..099}' \
        --rank 16 --out DIR

writes DIR/<name>/ for each name in the PEFT format (adapter_config.json +
adapter_model.safetensors): every projection (q/k/v/o/gate/up/down) adapted at `rank`, A and B
random and non-zero (each name its own seed), in the preset's dtype. A directory that already
holds an adapter of that name is kept (a set-up's adapters are written once per machine).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from models.config import ModelConfig
from models.lora.adapter import CONFIG_FILE, WEIGHT_FILES
from models.lora.weights import lora_targets
from models.presets import get_preset
from models.registry import get_model_class


def write_adapter(
    path: Path, targets: dict, rank: int, dtype: torch.dtype, seed: int, base: str
) -> None:
    """One adapter of `targets` (models.lora.lora_targets of the base) into directory `path`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for hf_path, t in targets.items():
        key = f"base_model.model.{hf_path}"
        # [r, in] and [out, r]: the delta's scale near the base's (std 1/sqrt(in) each)
        a = torch.randn(rank, t.in_features, generator=gen) / t.in_features**0.5
        b = torch.randn(t.out_features, rank, generator=gen) / rank**0.5
        tensors[f"{key}.lora_A.weight"] = a.to(dtype)
        tensors[f"{key}.lora_B.weight"] = b.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHT_FILES[0]))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({t.shard for t in targets.values()}),
        "bias": "none",
        "base_model_name_or_path": base,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config))  # last: its presence marks it whole


def write_adapters(
    root: str | Path, preset: str, names: Sequence[str], rank: int, seed: int = 0
) -> list[Path]:
    """root/<name> for each name: an adapter of rank `rank` of the preset's model (dummy
    weights) on every projection; the i-th with seed `seed + i`. Existing ones are kept."""
    if rank < 1:
        raise ValueError(f"rank must be positive, got {rank}")
    cfg = ModelConfig.from_hf(get_preset(preset))
    with torch.device("meta"):  # the projections' paths and shapes, no memory
        targets = lora_targets(get_model_class(cfg.hf_architecture)(cfg))
    dtype = cfg.dtype if cfg.dtype in (torch.float32, torch.bfloat16) else torch.float32
    dirs = []
    for i, name in enumerate(names):
        d = Path(root) / name
        if not (d / CONFIG_FILE).is_file():
            write_adapter(d, targets, rank, dtype, seed + i, f"dummy:{preset}")
        dirs.append(d)
    return dirs


def names_arg(text: str) -> list[str]:
    """'ft000,ft001' or 'ft{000..099}' (a zero-padded range) -> the names (each a directory
    name: no path separators)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if "{" in part and ".." in part and part.endswith("}"):
            prefix, span = part[:-1].split("{", 1)
            lo, hi = span.split("..")
            if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
                raise ValueError(f"expected a range {{low..high}} of whole numbers: {part!r}")
            out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        elif part:
            out.append(part)
    bad = [n for n in out if "/" in n or "\\" in n or n in (".", "..")]
    if bad:
        raise ValueError(f"adapter names are directory names, not paths: {bad[0]!r}")
    if not out or len(set(out)) != len(out):
        raise ValueError(f"expected distinct adapter names: {text!r}")
    return out
