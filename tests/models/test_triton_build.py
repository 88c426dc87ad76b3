"""Prism's Triton kernels build for Hopper (sm_90) on any machine: Triton's wheel ships ptxas,
so the GPU build (not the interpreter's) is compiled here down to cubins. A kernel that does not
type-check in Triton's compiler, or whose inline PTX does not assemble, fails here rather than
at model load on the GPU. (Running them on a GPU is tests/gpu/.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_every_kernel_builds_for_hopper(tmp_path):
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # built here, not found in an earlier run's cache
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "tests.models.hopper_build"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # 16 + 4 + 4 + 1 + 2 (the wide tile) decode builds, 2 rope + K/V write, 12 step ops, 10
    # GEMVs, 3 small GEMMs, 1 prefetch
    assert lines[-1] == "built 57", lines[-3:]
    assert "l2_prefetch: one cp.async.bulk.prefetch.L2.global" in lines
