"""The layers hold: import-linter's contracts (pyproject.toml), and the decision layer imports and
tests without torch; no file of the four packages grows past MAX_LINES (the engine's hubs past
HUB_LINES)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("prism_server", "kvpool", "models", "scheduler")
MAX_LINES = 500  # a file this long holds more than one job: split it by job
# the engine thread's two hubs stay small: the facade routes, the device worker actuates
HUB_LINES = {"prism_server/engine/engine.py": 300, "prism_server/engine/device_worker.py": 350}

# Run first in a fresh interpreter: any import of these raises, as if they were not installed.
BLOCK = textwrap.dedent(
    """
    import sys

    class _Block:
        blocked = ("torch", "numpy", "kvpool", "models", "prism_server")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.blocked:
                raise ImportError(f"{name} is not importable here")
            return None

    sys.meta_path.insert(0, _Block())
    """
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_no_file_of_the_packages_is_over_max_lines():
    """Kernel sources (models/kernels/) aside."""
    kernels = ROOT / "models" / "kernels"
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 100  # the packages were found
    counts = {
        str(f.relative_to(ROOT)): len(f.read_text().splitlines())
        for f in files
        if not f.is_relative_to(kernels)
    }
    over = {f: n for f, n in counts.items() if n > HUB_LINES.get(f, MAX_LINES)}
    assert not over, f"over {MAX_LINES} lines ({HUB_LINES} for the hubs): {over}"


def test_the_blocker_works():
    r = run("import torch")
    assert r.returncode != 0 and "torch is not importable here" in r.stderr


def test_scheduler_imports_without_torch():
    r = run(
        """
        import pkgutil, importlib, scheduler
        names = [m.name for m in pkgutil.walk_packages(scheduler.__path__, "scheduler.")]
        for name in names:
            importlib.import_module(name)
        assert "torch" not in sys.modules
        print(len(names))
        """
    )
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) >= 5  # request, sampling_params, batch_scheduler, snapshot, balloon


@pytest.mark.slow
def test_scheduler_tests_run_without_torch():
    r = run(
        """
        import pytest
        code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/scheduler"])
        assert "torch" not in sys.modules
        sys.exit(code)
        """
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout
