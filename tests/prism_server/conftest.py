"""A real Prism server (aiohttp on its own event loop thread) for the HTTP tests."""

from __future__ import annotations

import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import model_runner
from prism_server.engine.engine import Engine
from prism_server.serving.app import ServerThread, serve_in_thread


@pytest.fixture(scope="session")
def server() -> ServerThread:
    """Both embedded models on CPU; 4 MiB pages so requests span several pages."""
    specs = (ModelSpec("smollm2-135m", "smollm2-135m"), ModelSpec("gemma3-270m", "gemma3-270m"))
    engine = Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=4 << 20, kv_budget_bytes=512 << 20)
    )
    s = serve_in_thread(engine)
    yield s
    s.close()


@pytest.fixture(params=["read-first", "launch-ahead"])
def steps_ahead(request, monkeypatch) -> bool:
    """The engines a test builds read each step's tokens first, or launch the next decode step
    before reading them (the GPU's default, run here on the CPU)."""
    ahead = request.param == "launch-ahead"
    monkeypatch.setattr(model_runner, "launch_ahead_by_default", lambda device: ahead)
    return ahead
