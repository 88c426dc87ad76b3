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

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

pytest.importorskip("triton")


def test_every_kernel_builds_for_hopper(tmp_path):
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    # the decode kernel's builds in two halves and the others, three processes at once, each
    # building into a cache of its own under tmp_path (nothing found from an earlier run) and
    # writing its output to files there (no pipe to fill while another is waited for)
    parts = ("decode:0/2", "decode:1/2", "others")
    runs = {}
    for part in parts:
        at = tmp_path / part.replace("/", "-").replace(":", "-")
        at.mkdir()
        with open(at / "out", "w") as out, open(at / "err", "w") as err:
            runs[part] = (at, subprocess.Popen(
                [sys.executable, "-m", "tests.models.hopper_build", part],
                cwd=root, env={**env, "TRITON_CACHE_DIR": str(at)}, stdout=out, stderr=err,
            ))  # fmt: skip
    lines = {}
    for part, (at, run) in runs.items():
        assert run.wait(timeout=600) == 0, (at / "err").read_text()[-3000:]
        lines[part] = (at / "out").read_text().splitlines()
    # 16 + 4 + 4 + 1 + 2 (the wide tile) + 1 (8 warps) + 1 (a dense launch) decode builds; 8
    # rope + K/V write (one head and 8 a program, k and v out or not), 8 GEMVs in bf16, in
    # FP8 and in FP8 of 8-value loads, 8 small GEMMs (3 of them in FP8 too) and the prenorm,
    # 8 LoRA shrinks and 8 expands, 2 FP8 quantizers
    decode = [int(lines[p][-1].removeprefix("built ")) for p in ("decode:0/2", "decode:1/2")]
    assert decode == [15, 14], decode
    assert lines["others"][-1] == "built 63", lines["others"][-3:]
