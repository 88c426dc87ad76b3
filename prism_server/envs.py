"""Prism's environment variables, typed, in one place (all prefixed PRISM_). Read here, when an
engine is built, and passed down as values: nothing below prism_server reads the environment.
Every other setting is a config field (prism_server.config) or a kernel table
(models/kernels/configs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from models.kernels.tuning import KernelConfig


def cache_dir() -> Path:
    """Where converted model files are cached (PRISM_CACHE_DIR, default ~/.cache/prism)."""
    return Path(os.environ.get("PRISM_CACHE_DIR") or Path.home() / ".cache" / "prism")


def gguf_cache_dir() -> Path:
    """Where GGUF files are converted to HF-style directories (under cache_dir())."""
    return cache_dir() / "gguf"


def kernel_config_override() -> Path | None:
    """A kernel table applied over the GPU's own (PRISM_KERNEL_CONFIG=file.json, the form of
    models/kernels/configs/*.json): the lab's override, for measuring a setting; unset = none."""
    v = os.environ.get("PRISM_KERNEL_CONFIG")
    return Path(v) if v else None


def kernel_config(device: torch.device) -> KernelConfig:
    """The kernel settings of `device`: default.json, the table of its GPU model, then the
    override of PRISM_KERNEL_CONFIG (models.kernels.tuning)."""
    import torch

    from models.kernels.tuning import load_kernel_config

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return load_kernel_config(name, kernel_config_override())
