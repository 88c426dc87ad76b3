"""Start-up says what the engine runs on, and a GPU machine missing a piece gets one clear line
naming the package: cuda-python (an error: the VMM pool needs it) or FlashInfer (a warning: the
slow torch path). The GPU's side is simulated here; the real one runs in the GPU check. The
set-up script's decision is shown by its dry run."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prism_server.cli import main as cli
from prism_server.engine import gpu_setup

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H200")
    props = SimpleNamespace(total_memory=140 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(gpu_setup, "_cuda_python", lambda: "13.3.0")
    monkeypatch.setattr(gpu_setup, "_flashinfer", lambda: "0.6.18.post1")
    return monkeypatch


def test_the_cpu_says_it_runs_the_reference_path():
    (line,) = gpu_setup.check(torch.device("cpu"), "vmm")
    assert "attention torch" in line and "no CUDA graphs" in line and "memfd" in line


def test_a_complete_gpu_names_its_backends(fake_gpu):
    lines = gpu_setup.check(CUDA, "vmm")
    text = "\n".join(lines)
    assert "NVIDIA H200, 140 GiB" in text
    assert "VMM through the CUDA driver API (cuda-python 13.3.0)" in text
    assert "FlashInfer 0.6.18.post1" in text and "CUDA graphs for decode batches 1, 2" in text
    assert not any(line.startswith("WARNING") for line in lines)


def test_missing_flashinfer_is_one_warning_naming_the_package(fake_gpu, caplog):
    fake_gpu.setattr(gpu_setup, "_flashinfer", lambda: None)
    with caplog.at_level(logging.INFO, logger="prism"):
        gpu_setup.report(CUDA, "vmm")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "pip install flashinfer-python==0.6.18.post1" in msg and "slow torch path" in msg


def test_missing_cuda_python_is_one_error_line_from_the_cli(fake_gpu, capsys):
    fake_gpu.setattr(gpu_setup, "_cuda_python", lambda: None)
    with pytest.raises(gpu_setup.MissingPackage, match="pip install 'cuda-python==13"):
        gpu_setup.check(CUDA, "vmm")
    assert gpu_setup.check(CUDA, "tensor")  # the plain-tensor pool does not need it

    def engine_on_a_gpu(*a, **k):
        gpu_setup.check(CUDA, "vmm")

    fake_gpu.setattr(cli, "Engine", engine_on_a_gpu)
    assert cli.main(["generate", "--prompt", "hi", "--model", "dummy:tiny-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cuda-python is not installed"), err


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--cpu"], "no NVIDIA GPU: the CPU build of torch"),
        (["--gpu"], "torch 2.11.0 (CUDA 13.0), the gpu extras"),
        ([], "no NVIDIA GPU"),  # this machine has none
    ],
)
def test_the_setup_script_decides_by_the_gpu(flags, expect):
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/install.sh"), *flags, "--dry-run"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr


def test_the_gpu_extra_pins_the_tested_set():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"flashinfer-python=={gpu_setup.TESTED["flashinfer-python"]}"' in text
    assert "cuda-python>=13,<14" in text
    assert "TORCH_GPU=2.11.0" in (ROOT / "scripts/install.sh").read_text()
