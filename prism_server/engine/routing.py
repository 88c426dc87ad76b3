"""Where each model is served: the devices of the engine, the device a new model goes to (the
planner's choice), the device worker that steps each model, the commands held while a model
moves to another device, and the move itself (Detach on its device, Migrate on the other; back
where it was if that fails). Thread-safe: requests, admin calls and the control loop route
through it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import torch

from prism_server.config import ModelSpec
from prism_server.engine.commands import (
    Activate,
    Command,
    Detach,
    Evict,
    Migrate,
    Publish,
    Submit,
    TransitionRefused,
)
from prism_server.engine.device_worker import DeviceWorker
from prism_server.engine.loading import LoadSettings
from prism_server.served_model import ServedModel
from scheduler.planner import DeviceCapacity, ModelDemand, plan
from scheduler.request import FinishReason, Request, RequestOutput

log = logging.getLogger(__name__)


class Routes:
    def __init__(self, workers: list[DeviceWorker]):
        self.workers = workers
        self.where: dict[str, DeviceWorker] = {}  # model -> the worker of its device
        # a model moving to another device: the commands sent to it meanwhile, in order (they
        # go to its new device once it is there); guarded by _lock with `where`
        self._moving: dict[str, list[Command]] = {}
        self._lock = threading.Lock()

    def place(
        self, spec: ModelSpec, weight_of: Callable[[str], int], new_bytes: int
    ) -> tuple[DeviceWorker, tuple[DeviceWorker, ...]]:
        """Where a new model goes: the KVPR planner's choice over the devices, every model at
        the same nominal demand (nothing is known of the traffic yet): the device left with the
        most KV room beside the weights, config order breaking ties; and, for a model split
        over spec.tensor_parallel devices, the devices after it (its other shards').
        weight_of(name): a placed model's weight bytes."""
        workers = self.workers  # (EngineConfig checked that a split model's devices exist)
        dev = workers[0]
        if len(workers) > 1:
            cap = {w.name: w.pool.capacity * w.pool.page_bytes for w in workers}
            placed = [ModelDemand(n, max(weight_of(n), 1), 1.0, 1.0) for n in self.where]
            new = ModelDemand(spec.name, max(new_bytes, 1), 1.0, 1.0)
            current = {n: w.name for n, w in self.where.items()}
            got = plan(
                [*placed, new],
                [DeviceCapacity(n, c) for n, c in cap.items()],
                current,
                idle_kv_fraction=0.0,
            ).assignment.get(spec.name)
            by_name = {w.name: w for w in workers}
            # no place: it waits offloaded where the most pages are free
            dev = by_name[got[0]] if got else max(workers, key=lambda w: w.pool.num_available)
        i = workers.index(dev)
        return dev, tuple((workers[i:] + workers[:i])[1 : spec.tensor_parallel])

    def send(self, model: str, cmd: Command) -> None:
        """A command for a model's device (held while the model moves to another)."""
        with self._lock:
            held = self._moving.get(model)
            if held is not None:
                held.append(cmd)
            elif model in self.where:
                self.where[model].send(cmd)

    def after_publish(self, model: str, then: Callable[[], None]) -> None:
        """Have model's device publish a snapshot (taken after every command sent before), then
        call then() (on its thread): a model list or status read after sees those commands."""
        pub = Publish()
        pub.done.add_done_callback(lambda _: then())
        self.send(model, pub)

    def transition(self, cmd: Activate | Evict) -> Future:
        """Send an admin transition to its model's device (not while the model moves); -> a
        future of its outcome, done once the device has published a snapshot taken after it:
        a model list or status read after it shows the state it reached."""
        with self._lock:
            if cmd.model in self._moving:
                raise TransitionRefused(f"`{cmd.model}` is moving to another device; retry")
            dev = self.where[cmd.model]
        out: Future = Future()

        def published(done: Future) -> None:  # (on the engine thread)
            if done.exception() is not None:
                out.set_exception(done.exception())
                return
            self.after_publish(cmd.model, lambda: out.set_result(done.result()))

        cmd.done.add_done_callback(published)
        dev.send(cmd)
        return out

    def move(
        self, served: dict[str, ServedModel], name: str, device: str, settings: LoadSettings
    ) -> bool:
        """Move an offloaded model to `device` (the planner placed it there): it is built there
        from its host copy and is resident there; requests sent meanwhile wait and then go
        there. If that build fails it is rebuilt where it was (if that fails too, it is lost:
        served as failed). False if it cannot move now: it has requests, it is not offloaded
        for room, or `device` has not its weight pages free (moving evicts nobody), or it is
        split over several devices (it stays on them)."""
        was = served.get(name)
        dst = next((w for w in self.workers if w.name == device), None)
        if was is None or was.failed or dst is None or was.spec.tensor_parallel > 1:
            return False
        with self._lock:
            src = self.where.get(name)
            if src in (None, dst) or name in self._moving:
                return False
            self._moving[name] = []
        home, lost, reach = src, None, was.max_kv_tokens
        try:
            moved = src.execute(Detach(name, dst.name, dst.pool))
            if moved is None:
                return False
            try:
                reach = dst.execute(Migrate(was.spec, settings, *moved))
                home = dst
            except Exception:
                log.exception("moving %s to %s failed: it stays on %s", name, dst.name, src.name)
                try:
                    src.execute(Migrate(was.spec, settings, *moved))
                except Exception as e:
                    log.exception("model %s was lost moving to another device", name)
                    lost = f"{type(e).__name__}: {e}"
                    return False
            return home is dst
        finally:
            with self._lock:
                self.where[name] = home
                if lost is not None:
                    served[name] = replace(was, error=lost)
                elif home is not src:
                    served[name] = replace(was, device=home.name, max_kv_tokens=reach)
                held = self._moving.pop(name)
                if lost is None:
                    for cmd in held:
                        home.send(cmd)
            if lost is not None:  # what was sent meanwhile ends with the error
                for cmd in held:
                    if isinstance(cmd, Submit) and cmd.request.sink is not None:
                        cmd.request.sink(_failed(cmd.request, lost))


def device_list(device: torch.device, n: int) -> list[torch.device]:
    """The devices of an engine of n: on CUDA, GPUs 0 .. n-1 (one GPU: the configured one);
    on the host, n emulated devices."""
    if device.type != "cuda":
        return [device] * n
    have = torch.cuda.device_count()
    if n > have:
        raise ValueError(f"devices = {n}, but this machine has {have} CUDA device(s)")
    return [device] if n == 1 else [torch.device("cuda", i) for i in range(n)]


def _failed(req: Request, error: str) -> RequestOutput:
    return RequestOutput(
        req.request_id, [], "", None, True, FinishReason.ERROR, req.num_prompt_tokens, 0, error
    )
