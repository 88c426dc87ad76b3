"""The safetensors files of an HF checkpoint directory, read one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """Weight files of checkpoint directory `path`: the index's shards, or all *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shards: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (other formats unsupported)")
    return files


def iter_safetensors(
    files: Sequence[Path], desc: str = "loading"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of `files`; one tensor in memory at a time."""
    handles = []
    try:
        for file in files:
            handles.append((file, safe_open(file, "pt", device="cpu")))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from e
    total = sum(len(h.keys()) for _, h in handles)
    with tqdm(total=total, desc=desc, disable=True if total < 100 else None) as bar:
        for file, handle in handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise ValueError(f"{file}: cannot read tensor {name!r}: {e}") from e
                yield name, tensor
                bar.update()
