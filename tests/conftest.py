"""Set-up for the whole suite, before any test module imports."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton's kernels run under its interpreter (it must be chosen before triton is
# first imported: the language's own helpers are built then): tests/models/test_triton_ops.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
