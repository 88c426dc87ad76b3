"""The engine thread of one device: steps every resident model, so the event loop never blocks on
model work. Other threads talk to it only through `submit` / `abort` (a queue) and the sinks."""

from __future__ import annotations

import logging
import queue
import threading

from kvpool import PagePool
from prism_server.model_engine import ModelEngine
from prism_server.request import Request

log = logging.getLogger(__name__)

# How long to sleep when some model has work it cannot schedule yet (blocked on memory).
_BLOCKED_POLL_S = 0.005


class DeviceEngine:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.device = pool.backend.device
        self.models: dict[str, ModelEngine] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(
            target=self._loop, name=f"prism-engine-{self.device}", daemon=True
        )

    def add_model(self, engine: ModelEngine) -> None:
        self._call(lambda: self.models.__setitem__(engine.name, engine))

    def remove_model(self, name: str) -> None:
        self._call(lambda: self.models.pop(name).close())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    # ---- thread-safe entry points ---------------------------------------------------------------
    def submit(self, model: str, req: Request) -> None:
        self._post(lambda: self.models[model].add(req))

    def abort(self, model: str, request_id: str) -> None:
        self._post(lambda: self.models[model].abort(request_id))

    def _post(self, fn) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def _call(self, fn) -> None:
        """Run fn on the engine thread (or here if it is not running) and wait for it."""
        if not self._thread.is_alive():
            fn()
            return
        done = threading.Event()
        err: list[BaseException] = []

        def run():
            try:
                fn()
            except BaseException as e:
                err.append(e)
            finally:
                done.set()

        self._post(run)
        done.wait()
        if err:
            raise err[0]

    # ---- the loop -------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("engine command failed")

    def step(self) -> bool:
        """Steps each model that has work once; True if any ran a batch."""
        ran = False
        for m in list(self.models.values()):
            if m.has_work:
                try:
                    ran |= m.step()
                except Exception as e:  # a broken model must not stop the device's thread
                    log.exception("model %s failed outside its batch", m.name)
                    m.fail_all(f"{type(e).__name__}: {e}")
                    ran = True
        return ran

    def _loop(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._drain()
            if self.step():
                continue
            busy = any(m.has_work for m in self.models.values())
            self._wake.wait(timeout=_BLOCKED_POLL_S if busy else None)
        self._drain()
