"""Set-up for the whole suite, before any test module imports."""

from __future__ import annotations

import os

import pytest

# Without a GPU, Triton's kernels run under its interpreter (it must be chosen before triton is
# first imported: the language's own helpers are built then): tests/models/test_triton_ops.py.
# The scheduler's tests also run where torch cannot be imported: then there is nothing to set.
try:
    import torch
except ImportError:
    torch = None
if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core, at most four. Each worker imports torch and loads its own
    models, so the cap bounds the suite's memory on a machine of many cores."""
    return max(1, min(4, os.cpu_count() or 1))
