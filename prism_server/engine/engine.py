"""The engine: the process facade. It builds each device's page pool and worker thread, loads the
configured models onto them (Load commands: each device's thread builds its models), keeps one
ServedModel per model for the frontend, and hands requests and moves to the right device as typed
commands. `generate` is the synchronous convenience API."""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch

from models.lora import AdapterError  # noqa: F401 (the frontend's: a bad adapter)
from prism_server import envs
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import gpu_setup
from prism_server.engine.adapter_registry import AdapterRegistry
from prism_server.engine.commands import (
    Abort,
    Activate,
    Evict,
    KVReach,
    Load,
    Partition,
    RemoveModel,
    Submit,
    TransitionRefused,
)
from prism_server.engine.control_loop import ControlLoop, PlanView
from prism_server.engine.device_worker import DeviceWorker
from prism_server.engine.loading import Loaded, LoadSettings
from prism_server.engine.memory_budget import check_host_budget, device_pool, weight_bytes
from prism_server.engine.routing import Routes, device_list
from prism_server.served_model import ModelFailed, ModelNotFound, ServedModel
from scheduler.policy import policy
from scheduler.request import Request, RequestOutput
from scheduler.sampling_params import SamplingParams
from scheduler.snapshot import DeviceSnapshot

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig | None = None, strict: bool = True):
        """strict: a model that fails to load raises; otherwise it is served as failed (its
        requests get ModelFailed) and the other models are served."""
        self.config = config = config or EngineConfig()
        self.device = config.torch_device()
        if self.device.type == "cpu" and config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        devices = device_list(self.device, config.devices)
        kernels = envs.kernel_config(self.device)  # the GPU's table, then PRISM_KERNEL_CONFIG
        for d in devices:  # MissingPackage: cannot run here
            gpu_setup.report(d, config.memory_backend, kernels, config.enforce_eager)
        self.host_budget = check_host_budget(config, self.device)  # adapters take from it
        self.policy = policy(config.policy)
        # one page pool and one engine thread per device: each GPU of devices (cuda:0 ..), or
        # several emulated CPU devices (each its own pool and thread), for the multi-device
        # control plane on any machine
        self._workers: list[DeviceWorker] = []
        for i, device in enumerate(devices):
            name = str(self.device) if config.devices == 1 else f"{self.device.type}:{i}"
            w = DeviceWorker(
                device_pool(config, device),
                self.policy,
                name=name,
                trace=Path(config.step_trace) if config.step_trace else None,
                kernels=kernels,
                enforce_eager=config.enforce_eager,
            )
            w.start()
            self._workers.append(w)
        self.worker, self.pool = self._workers[0], self._workers[0].pool  # the first device
        for w in self._workers:
            w.peers = {o.name: o for o in self._workers if o is not w}
        self._routes = Routes(self._workers)  # where each model is served
        self.served: dict[str, ServedModel] = {}  # config order, failed models included
        self._ids = itertools.count()
        self._settings = LoadSettings.of(config, self.policy, self.device)
        self.adapters = AdapterRegistry(config, self.served, self._routes, self.host_budget)
        # the base models first: an adapter is placed beside its base
        for spec in sorted(config.models, key=lambda s: s.is_adapter):
            try:
                self.load(spec)
            except Exception as e:
                if strict:
                    self.close()
                    raise
                log.error("model %s failed to load: %s", spec.name, e)
                self.served[spec.name] = ServedModel(spec, error=f"{type(e).__name__}: {e}")
        for dev in self._workers:
            try:  # each model's reach (static: the room beside the weights in equal, fixed quotas)
                max_kv = dev.execute(Partition() if self.policy.all_resident else KVReach())
            except MemoryError:
                self.close()
                raise
            for n, tokens in max_kv.items():
                self.served[n] = replace(self.served[n], max_kv_tokens=tokens)
        for n, served in list(self.served.items()):  # an adapter's limits are its base's
            base = self.served.get(served.spec.base) if served.spec.is_adapter else None
            if base is not None and not served.failed and not base.failed:
                self.served[n] = replace(base, spec=served.spec)
        self.control: ControlLoop | None = None
        if self.policy.plan:
            self.control = ControlLoop(self, config.plan_interval_s)
            self.control.start()

    def plan_view(self) -> PlanView | None:
        """The control loop's last plan (None: no planner, or none yet)."""
        return self.control.last if self.control is not None else None

    @property
    def workers(self) -> list[DeviceWorker]:
        return list(self._workers)

    def load(self, spec: ModelSpec) -> ServedModel:
        """Load a model into the pool (its weights in pool pages, a host copy beside them). Idle
        models are evicted while it loads if the pool needs their pages; it then stays resident
        only if they fit back without it (config order wins), else it is offloaded. A model
        split over devices (Routes.place) is evicted and activated like any model, all shards
        at once; it never moves to other devices."""
        if spec.name in self.served:
            raise ValueError(f"a model named {spec.name!r} is already loaded")
        if spec.is_adapter:
            return self.adapters.start_load(spec.name, spec.adapter, spec.base, spec).result()
        dev, shards = self._routes.place(
            spec, lambda n: self.model_snapshot(n).weight_bytes, weight_bytes(spec, self.device)
        )
        loaded: Loaded = dev.execute(Load(spec, self._settings, shards))
        if loaded.evicted:  # earlier models first: this one waits offloaded
            dev.execute(Evict(spec.name))
            for name in loaded.evicted:
                dev.execute(Activate(name))
        self._routes.where[spec.name] = dev
        self.served[spec.name] = served = loaded.served(spec, dev.name)
        return served

    # ---- the frontend's side ---------------------------------------------------------------------
    def model(self, name: str) -> ServedModel:
        """The served model called `name`: ModelNotFound if none, ModelFailed if it failed."""
        served = self.served.get(name)
        if served is None:
            raise ModelNotFound(name)
        if served.failed:
            raise ModelFailed(name, served.error)
        return served

    def snapshots(self) -> list[DeviceSnapshot]:
        """The latest published state of every device (immutable; safe from any thread)."""
        return [w.snapshot for w in self.workers]

    def model_snapshot(self, name: str, now: bool = True):
        """The ModelSnapshot of `name` (None if it has none); now=True waits for one taken after
        the step in progress, else the last published."""
        snaps = (w.snapshot_now() if now else w.snapshot for w in self.workers)
        return next((m for snap in snaps if (m := snap.model(name)) is not None), None)

    def submit(
        self,
        served: ServedModel,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None] | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request already checked by `served.check` (thread-safe). Its id is new and
        internal: never a client's. ModelNotFound for an adapter unloaded since its lookup."""
        rid = f"r{next(self._ids)}"
        arrival = time.monotonic() if arrival_time is None else arrival_time
        adapter = served.name if served.spec.is_adapter else None
        req = Request(rid, prompt_ids, params, served.eos_token_ids, arrival, sink, adapter)
        if adapter is not None:  # an adapter's own SLOs (else its base's, set by the worker)
            spec = served.spec
            req.ttft_slo = spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None
            req.tpot_slo = spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None
        if adapter is None:
            self._routes.send(served.name, Submit(served.name, req))
        else:  # ModelNotFound if it was unloaded since its lookup
            self.adapters.submit(adapter, Submit(served.spec.base, req))
        return req

    def add_request(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None] | None = None,
    ) -> Request:
        """Looks up, encodes, checks and queues (thread-safe). Raises ModelNotFound, ModelFailed,
        or RequestRejected (a ValueError) before anything is queued."""
        served = self.model(model)
        ids = served.encode(prompt)
        served.check(len(ids), params.max_tokens)
        return self.submit(served, ids, params, sink)

    def abort(self, model: str, request_id: str) -> None:
        model = self.adapters.device_model(model)
        self._routes.send(model, Abort(model, request_id))

    def activate(self, name: str) -> float:
        """Make a model resident now (thread-safe; blocks until done); returns the seconds the
        transition took. TransitionRefused if it cannot be done now."""
        return _waited(self.start_activate(name))

    def evict(self, name: str, drain_s: float | None = None) -> float:
        """Offload a model (thread-safe; blocks until done): its running requests may finish for
        up to drain_s seconds (default: its drain_timeout_s), the rest are requeued; returns the
        seconds the transition took. TransitionRefused for a pinned model."""
        return _waited(self.start_evict(name, drain_s))

    def start_activate(self, name: str) -> Future:
        """Send a model's activation (thread-safe; returns at once): the future resolves once it
        serves, or with TransitionRefused."""
        self._not_adapter(self.model(name))
        return self._routes.transition(Activate(name))

    def start_evict(self, name: str, drain_s: float | None = None) -> Future:
        """Send a model's eviction (as `evict`; returns at once): the future resolves once it is
        offloaded, or with TransitionRefused (pinned, or activated while it drained)."""
        drain = self._not_adapter(self.model(name)).spec.drain_timeout_s
        drain = drain if drain_s is None else drain_s
        return self._routes.transition(Evict(name, drain))

    @staticmethod
    def _not_adapter(served: ServedModel) -> ServedModel:
        if served.spec.is_adapter:
            raise TransitionRefused(
                f"`{served.name}` is a LoRA adapter: it is activated for its requests and "
                f"evicted with its base `{served.spec.base}` (activate or evict that)"
            )
        return served

    def migrate(self, name: str, device: str) -> bool:
        """Move an offloaded model to `device` (the planner placed it there): Routes.move. False
        if it cannot move now (it stays)."""
        return self._routes.move(self.served, name, device, self._settings)

    def encode(self, model: str, prompt: str | list[int]) -> list[int]:
        return self.model(model).encode(prompt)

    def generate(
        self, model: str, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[Completion]:
        """Runs all prompts concurrently and waits for them."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        results: list[Completion] = []
        for p in prompts:
            ids = self.encode(model, p)
            c = Completion(ids, arrival_time=time.monotonic())

            def sink(out: RequestOutput, c=c) -> None:
                c.add(out, time.monotonic())
                if out.finished:
                    done.put(None)

            self.add_request(model, ids, params, sink)
            results.append(c)
        for _ in results:
            done.get()
        return results

    # ---- checks and shutdown --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool and every model's KV accounting are exact (call when the engine is idle)."""
        for w in self.workers:
            w.check_integrity()

    def close(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.stop()
        for name, served in list(self.served.items()):
            if not served.failed and name in self._routes.where:
                self._routes.where.pop(name).execute(RemoveModel(name))
            del self.served[name]
        for w in self._workers:
            w.stop()
            w.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _waited(done: Future) -> float:
    """Wait for a transition's future; -> the seconds it took."""
    t = time.perf_counter()
    done.result()
    return time.perf_counter() - t
