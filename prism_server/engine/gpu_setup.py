"""What the engine runs on, said once at start-up, and the pieces a GPU needs, checked before
anything uses them: cuda-python for the VMM page pool (missing: one error line naming the
package), FlashInfer for paged attention and CUDA graphs (missing: one warning line, then the
torch reference path, slow and without graphs)."""

from __future__ import annotations

import importlib.metadata
import logging

import torch

from models.kernels.tuning import KernelConfig
from prism_server import envs
from prism_server.engine.cuda_graph_runner import DEFAULT_BATCH_SIZES

log = logging.getLogger("prism")

# the set tested together on the GPU machine (pyproject's gpu extra pins the same)
TESTED = {"torch": "2.11", "flashinfer-python": "0.6.18.post1", "cuda-python": "13"}


class MissingPackage(RuntimeError):
    """A package this device needs is not installed; the message names it."""


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_python() -> str | None:
    """The installed cuda-python (or its cuda-bindings) version, None if it does not import."""
    try:
        from kvpool.cuda_backend import _driver_module

        _driver_module()
    except ImportError:
        return None
    return version("cuda-python") or version("cuda-bindings") or "?"


def _flashinfer() -> str | None:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return None
    return version("flashinfer-python") or "?"


def check(
    device: torch.device,
    memory_backend: str,
    kernels: KernelConfig | None = None,
    enforce_eager: bool = False,
) -> list[str]:
    """The start-up lines for `device` (logged by the engine) under its kernel settings
    (None: the defaults) and EngineConfig.enforce_eager; MissingPackage if it cannot run here.
    On a GPU a missing FlashInfer is a warning line, not an error."""
    kernels = kernels or KernelConfig()
    if device.type != "cuda":
        pool = "plain tensors" if memory_backend == "tensor" else "host memory (memfd pages)"
        return [f"{device}: attention torch (the reference path), no CUDA graphs, page pool {pool}"]
    name = torch.cuda.get_device_name(device)
    gib = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    lines = [
        f"{device}: {name}, {gib:.0f} GiB, torch {torch.__version__} (CUDA {torch.version.cuda})"
    ]
    if memory_backend == "vmm":
        cp = _cuda_python()
        if cp is None:
            raise MissingPackage(
                "cuda-python is not installed: the VMM page pool needs it on a GPU; install it "
                f"with pip install 'cuda-python=={TESTED['cuda-python']}.*' (or pip install "
                "-e '.[gpu]'), or set memory_backend = \"tensor\" (no balloon)"
            )
        lines.append(f"{device}: page pool VMM through the CUDA driver API (cuda-python {cp})")
    else:
        lines.append(f"{device}: page pool plain tensors (memory_backend = tensor: no balloon)")
    fi = _flashinfer()
    if fi is None:
        lines.append(
            f"WARNING {device}: flashinfer-python is not installed: attention runs on the slow "
            "torch path, without CUDA graphs; install it with pip install "
            f"flashinfer-python=={TESTED['flashinfer-python']} (or pip install -e '.[gpu]')"
        )
    else:
        k = kernels
        sizes = ", ".join(map(str, DEFAULT_BATCH_SIZES))
        graphs = (
            "no CUDA graphs and no decode step launched ahead (enforce_eager)"
            if enforce_eager
            else f"CUDA graphs for decode batches {sizes}, piecewise for other steps of up to "
            f"{k.piecewise_max_tokens} tokens, decode steps launched ahead"
        )
        gemv = "off" if k.gemv is None else k.gemv
        small = "off" if k.small_gemm is None else k.small_gemm
        override = envs.kernel_config_override()
        lines.append(
            f"{device}: attention FlashInfer {fi} ({k.prefill_backend} prefill from "
            f"{k.prefill_backend_min_tokens} tokens, fa2 below; fresh prompts ragged, prefixes "
            f"paged), Triton decode up to {k.decode_backend_max_batch} sequences, "
            f"FlashInfer's above; GEMVs {gemv}, small GEMMs {small}"
            f"{f' (kernel table {override})' if override else ''}; {graphs}"
        )
    return lines


def report(
    device: torch.device,
    memory_backend: str,
    kernels: KernelConfig | None = None,
    enforce_eager: bool = False,
) -> None:
    for line in check(device, memory_backend, kernels, enforce_eager):
        if line.startswith("WARNING "):
            log.warning(line.removeprefix("WARNING "))
        else:
            log.info(line)
