"""Set-up for the whole suite, before any test module imports."""

from __future__ import annotations

import os

# Without a GPU, Triton's kernels run under its interpreter (it must be chosen before triton is
# first imported: the language's own helpers are built then): tests/models/test_triton_ops.py.
# The scheduler's tests also run where torch cannot be imported: then there is nothing to set.
try:
    import torch
except ImportError:
    torch = None
if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
