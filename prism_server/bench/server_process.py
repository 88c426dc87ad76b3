"""One `python -m prism_server` per policy for the sweep: started on a free port with the
sweep's config, waited for until healthy, stopped with SIGTERM; and the wait for a quiet server
between runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from prism_server.bench.sweep import SweepConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m prism_server` under one policy, its output in a log file."""

    def __init__(
        self,
        cfg: SweepConfig,
        policy: str,
        log_path: Path,
        slo_file: Path | None = None,
        request_log: Path | None = None,
    ):
        """request_log: where the server writes a line per request (None: no log)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "prism_server", "--policy", policy]
        self.cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if cfg.server_config:
            self.cmd += ["--config", str(cfg.server_config)]
        if cfg.api_key:
            self.cmd += ["--api-key", cfg.api_key]
        if slo_file is not None:
            self.cmd += ["--slo-file", str(slo_file)]
        if request_log is not None:
            self.cmd += ["--request-log", str(request_log)]
        self.request_log = request_log
        self.cmd += list(cfg.server_args)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as logf:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    async def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode}:\n{self._tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n{self._tail()}")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def wait_quiet(
    url: str, api_key: str | None, settle_s: float, timeout_s: float = 300
) -> None:
    """Waits until no model has a running or waiting request, then settle_s more."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while time.monotonic() < deadline:
            async with s.get(url + "/v1/status", headers=headers) as r:
                st = await r.json()
            busy = sum(
                m["num_running"] + m["num_waiting"] for d in st["devices"] for m in d["models"]
            )
            if not busy:
                break
            await asyncio.sleep(0.2)
    await asyncio.sleep(settle_s)
