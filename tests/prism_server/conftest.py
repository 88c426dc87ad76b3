"""A real Prism server (aiohttp on its own event loop thread) for the HTTP tests."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine
from prism_server.server.app import serve
from prism_server.server_args import ServerArgs


@dataclass
class RunningServer:
    engine: Engine
    url: str
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    thread: threading.Thread

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=60)
        self.engine.close()


def start_server(engine: Engine, **args) -> RunningServer:
    sargs = ServerArgs(port=0, engine=engine.config, **args)
    started = threading.Event()
    box: dict = {}

    async def main():
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await serve(
            engine,
            sargs,
            ready=lambda port: (box.update(port=port), started.set()),
            stop=box["stop"],
        )

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(60), "server did not start"
    return RunningServer(
        engine, f"http://127.0.0.1:{box['port']}", box["loop"], box["stop"], thread
    )


@pytest.fixture(scope="session")
def server() -> RunningServer:
    """Both embedded models on CPU; 4 MiB pages so requests span several pages."""
    specs = (ModelSpec("smollm2-135m", "smollm2-135m"), ModelSpec("gemma3-270m", "gemma3-270m"))
    engine = Engine(
        EngineConfig(models=specs, device="cpu", page_bytes=4 << 20, kv_budget_bytes=512 << 20)
    )
    s = start_server(engine)
    yield s
    s.close()
