"""The engine: the process facade. It builds each device's page pool and worker thread, loads the
configured models onto them, keeps one ServedModel per model for the frontend, and hands requests
to the right device as typed commands. `generate` is the synchronous convenience API."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kvpool import (
    HostCopy,
    PagePool,
    ShardedHostCopy,
    ShardedWeights,
    WeightBuffer,
    WeightLayout,
)
from models.embedded import resolve_source
from models.loader import ModelSource, empty_model, load_model, load_shards
from models.tensor_parallel import TensorParallel
from prism_server import envs, gpu_setup
from prism_server.commands import (
    Abort,
    Activate,
    AddModel,
    Evict,
    RemoveModel,
    Submit,
    TransitionRefused,
)
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.control_loop import ControlLoop, PlanView
from prism_server.device_worker import DeviceWorker
from prism_server.grammar import Grammars
from prism_server.memory_budget import check_host_budget, make_backend, pool_budget, weight_bytes
from prism_server.model_worker import ModelWorker
from prism_server.served_model import ModelFailed, ModelNotFound, ServedModel
from prism_server.worker_build import build_worker
from scheduler.planner import DeviceCapacity, ModelDemand, plan
from scheduler.policy import policy, static_quota
from scheduler.request import FinishReason, Request, RequestOutput
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
        devices = _devices(self.device, config.devices)
        kernels = envs.kernel_config(self.device)  # the GPU's table, then PRISM_KERNEL_CONFIG
        for d in devices:  # MissingPackage: cannot run here
            gpu_setup.report(d, config.memory_backend, kernels, config.enforce_eager)
        check_host_budget(config, self.device)
        self.policy = policy(config.policy)
        # one page pool and one engine thread per device: each GPU of devices (cuda:0 ..), or
        # several emulated CPU devices (each its own pool and thread), for the multi-device
        # control plane on any machine
        self._workers: list[DeviceWorker] = []
        for i, device in enumerate(devices):
            budget = pool_budget(config, device)
            # On a GPU the pool creates every handle now (creating is the slow driver call) and
            # keeps them; on the host it creates them on demand.
            precreate = budget // config.page_bytes if device.type == "cuda" else 0
            pool = PagePool(
                make_backend(device, config.memory_backend),
                config.page_bytes,
                budget,
                precreate,
            )
            name = str(self.device) if config.devices == 1 else f"{self.device.type}:{i}"
            w = DeviceWorker(
                pool,
                self.policy,
                name=name,
                trace=Path(config.step_trace) if config.step_trace else None,
                kernels=kernels,
                launch_ahead=False if config.enforce_eager else None,
                piecewise=not config.enforce_eager,
            )
            w.start()
            self._workers.append(w)
        self.worker, self.pool = self._workers[0], self._workers[0].pool  # the first device
        for w in self._workers:
            w.peers = {o.name: o for o in self._workers if o is not w}
        self._where: dict[str, DeviceWorker] = {}  # model -> the worker of its device
        # a model moving to another device: the commands sent to it meanwhile, in order (they
        # go to its new device once it is there); guarded by _route with _where
        self._moving: dict[str, list] = {}
        self._route = threading.Lock()
        self.served: dict[str, ServedModel] = {}  # config order, failed models included
        self._ids = itertools.count()
        for spec in config.models:
            try:
                self.load(spec)
            except Exception as e:
                if strict:
                    self.close()
                    raise
                log.error("model %s failed to load: %s", spec.name, e)
                self.served[spec.name] = ServedModel(spec, error=f"{type(e).__name__}: {e}")
        if self.policy.all_resident:
            self._partition()
        self.control: ControlLoop | None = None
        if self.policy.plan:
            self.control = ControlLoop(self, config.plan_interval_s)
            self.control.start()

    def plan_view(self) -> PlanView | None:
        """The control loop's last plan (None: no planner, or none yet)."""
        return self.control.last if self.control is not None else None

    def _profile_budget(self) -> float:
        b = self.config.profile_budget_s
        return b if b is not None else (2.5 if self.device.type == "cuda" else 0.25)

    def _partition(self) -> None:
        """static: the KV room the weights leave, split into fixed equal quotas that are never
        reclaimed (each model keeps what it maps)."""
        for dev in self._workers:
            loaded = [n for n, s in self.served.items() if not s.failed and self._where[n] is dev]

            def split(dev=dev, loaded=loaded) -> int:
                ws = [dev.models[n] for n in loaded]
                quota = static_quota(dev.pool.capacity, [w.weights.num_pages for w in ws])
                for w in ws:
                    w.kv.allocator.set_quota(quota)
                    w.kv.allocator.max_cached_pages = quota
                return quota

            quota = dev.call(split)
            if loaded and quota < 1:
                self.close()
                raise MemoryError(
                    f"the static policy needs every model resident with KV room: the weights of "
                    f"{', '.join(loaded)} leave no page of the {dev.pool.capacity} in the pool "
                    f"of {dev.name}"
                )
            for n in loaded:
                self.served[n] = replace(self.served[n], max_kv_tokens=dev.models[n].max_kv_tokens)
            log.info(
                "static partition on %s: %d KV pages for each of %d models",
                dev.name,
                quota,
                len(loaded),
            )

    @property
    def workers(self) -> list[DeviceWorker]:
        return list(self._workers)

    def _device_for(self, spec: ModelSpec) -> DeviceWorker:
        """Where a new model goes: the KVPR planner's choice over the devices, every model at
        the same nominal demand (nothing is known of the traffic yet): the device left with the
        most KV room beside the weights, config order breaking ties."""
        if len(self._workers) == 1:
            return self._workers[0]
        cap = {w.name: w.pool.capacity * w.pool.page_bytes for w in self._workers}
        placed = [
            ModelDemand(n, max(self.model_snapshot(n).weight_bytes, 1), 1.0, 1.0)
            for n in self._where
        ]
        new = ModelDemand(spec.name, max(weight_bytes(spec, self.device), 1), 1.0, 1.0)
        current = {n: w.name for n, w in self._where.items()}
        got = plan(
            [*placed, new],
            [DeviceCapacity(n, c) for n, c in cap.items()],
            current,
            idle_kv_fraction=0.0,
        ).assignment.get(spec.name)
        by_name = {w.name: w for w in self._workers}
        if got:
            return by_name[got[0]]
        return max(self._workers, key=lambda w: w.pool.num_available)  # it waits offloaded

    def load(self, spec: ModelSpec) -> ServedModel:
        """Load a model into the pool (its weights in pool pages, a host copy beside them). Idle
        models are evicted while it loads if the pool needs their pages; it then stays resident
        only if they fit back without it (config order wins), else it is offloaded."""
        if spec.name in self.served:
            raise ValueError(f"a model named {spec.name!r} is already loaded")
        if spec.tensor_parallel > 1:
            return self._load_sharded(spec)
        dtype = spec.torch_dtype(self.device)
        dev = self._device_for(spec)
        pool = dev.pool
        device = pool.backend.device  # the model's GPU (or the host)
        box: dict = {}

        def place(tensors):
            wb = box["weights"] = WeightBuffer(
                pool, f"{spec.name}/weights", WeightLayout.pack(tensors)
            )
            box["evicted"] = dev.call(lambda: dev.make_room(wb.can_map, time.monotonic()))
            if box["evicted"] and self.policy.all_resident:
                raise MemoryError(
                    f"the static policy keeps every model resident, and {spec.name} does not "
                    f"fit beside {', '.join(self.served)}; raise pool_budget_bytes"
                )
            if not dev.call(wb.map):
                raise MemoryError(
                    f"the page pool ({pool.capacity} pages of {pool.page_bytes} bytes) "
                    f"cannot hold the {wb.nbytes} bytes of {spec.name}'s weights; raise "
                    "pool_budget_bytes"
                )
            return wb.views()

        try:
            with _current(device):
                worker, loaded, sched = self._build(spec, dtype, dev, device, place, box)
        except BaseException:
            if "weights" in box:
                dev.call(box["weights"].close)
            for name in box.get("evicted", ()):  # as it was before this load
                dev.execute(Activate(name))
            raise
        cfg, tok = loaded.config, loaded.tokenizer
        dev.execute(AddModel(worker))
        if box["evicted"]:  # earlier models first: this one waits offloaded
            dev.execute(Evict(spec.name))
            for name in box["evicted"]:
                dev.execute(Activate(name))
        return self._serve(spec, dev, worker, cfg, tok, sched)

    def _serve(self, spec: ModelSpec, dev: DeviceWorker, worker, cfg, tok, sched) -> ServedModel:
        """The frontend's view of a model just added to dev."""
        eos = frozenset(cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos |= {tok.eos_token_id}
        self._where[spec.name] = dev
        served = ServedModel(
            spec,
            device=dev.name,
            tokenizer=tok,
            max_model_len=sched.max_model_len,
            max_kv_tokens=worker.max_kv_tokens,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos,
            grammars=Grammars(tok, cfg.vocab_size, eos),
        )
        self.served[spec.name] = served
        return served

    def _load_sharded(self, spec: ModelSpec) -> ServedModel:
        """A model split over spec.tensor_parallel devices: the one the planner picks and the
        next ones. Each shard's weights go into its device's pool, with a host copy of each; the
        first device's engine thread steps it (the other devices run its shards' kernels beside
        their own models'). Evicted and activated like any model, all shards at once (the other
        devices' pools give it free pages only); never moved to other devices."""
        n = spec.tensor_parallel
        if n > len(self._workers):
            raise ValueError(
                f"{spec.name}: tensor_parallel = {n}, but the engine has {len(self._workers)} "
                "device(s) (set devices)"
            )
        lead = self._device_for(spec)
        i = self._workers.index(lead)
        devs = (self._workers[i:] + self._workers[:i])[:n]
        devices = [d.pool.backend.device for d in devs]
        dtype = spec.torch_dtype(self.device)
        buffers: list[WeightBuffer] = []
        hosts: list[HostCopy] = []

        def placer(dev: DeviceWorker, rank: int):
            def place(tensors):
                owner = f"{spec.name}/weights" + (f".{rank}" if rank else "")
                wb = WeightBuffer(dev.pool, owner, WeightLayout.pack(tensors), reclaim=rank == 0)
                buffers.append(wb)
                if not dev.call(wb.map):
                    raise MemoryError(
                        f"{dev.name}'s page pool ({dev.pool.num_available} pages free of "
                        f"{dev.pool.capacity}) cannot hold the {wb.nbytes} bytes of shard {rank} "
                        f"of {spec.name}; load it first, or raise pool_budget_bytes"
                    )
                return wb.views()

            return place

        try:
            with _current(devices[0]):
                loaded = load_shards(
                    ModelSource.parse(resolve_source(spec.source)),
                    devices,
                    [placer(d, r) for r, d in enumerate(devs)],
                    dtype=dtype,
                    seed=spec.seed,
                    cache_root=envs.gguf_cache_dir(),
                )
                sched = self._scheduler_config(spec, loaded.config.max_position_embeddings)
                for wb, device in zip(buffers, devices):
                    hosts.append(HostCopy(wb.nbytes, device))
                    hosts[-1].save(wb.bytes())
                worker = self._worker(
                    spec,
                    TensorParallel(loaded.shards, devices),
                    loaded.tokenizer,
                    lead,
                    sched,
                    dtype,
                    ShardedWeights(buffers),
                    ShardedHostCopy(hosts),
                    profile=False,
                    shard_pools=[d.pool for d in devs[1:]],
                    shard_devices=[d.name for d in devs[1:]],
                )
        except BaseException:
            for wb, d in zip(buffers, devs):
                d.call(wb.close)
            for h in hosts:
                h.close()
            raise
        lead.execute(AddModel(worker))
        return self._serve(spec, lead, worker, loaded.config, loaded.tokenizer, sched)

    def _scheduler_config(self, spec: ModelSpec, max_position_embeddings: int):
        reserve = self.config.reserve_output_tokens
        if reserve is None:
            reserve = self.policy.reserve_output_tokens
        return spec.scheduler_config(
            max_position_embeddings, reserve, self.config.enable_prefix_caching
        )

    def _build(self, spec: ModelSpec, dtype, dev: DeviceWorker, device, place, box: dict):
        """The model's weights loaded into dev's pool (through `place`), its host copy and its
        worker (runner, graphs, latency profile), built on `device` (current while it runs).
        -> (worker, the loaded model, its scheduler config)."""
        loaded = load_model(
            ModelSource.parse(resolve_source(spec.source)),
            dtype=dtype,
            device=device,
            seed=spec.seed,
            cache_root=envs.gguf_cache_dir(),
            place=place,
        )
        sched = self._scheduler_config(spec, loaded.config.max_position_embeddings)
        weights = box["weights"]
        host = HostCopy(weights.nbytes, device)
        host.save(weights.bytes())
        worker = self._worker(
            spec, loaded.model, loaded.tokenizer, dev, sched, dtype, weights, host
        )
        return worker, loaded, sched

    def _worker(
        self,
        spec: ModelSpec,
        model,
        tokenizer,
        dev: DeviceWorker,
        sched,
        dtype,
        weights,
        host,
        profile: bool = True,
        **shards,
    ) -> ModelWorker:
        """The worker of `spec`'s model on dev, its weights and host copy given (profile: its
        latency profile now, within the engine's budget; shards: a split model's other
        shards' pools and devices, as ModelWorker takes them)."""
        return build_worker(
            spec.name,
            model,
            tokenizer,
            dev.pool,
            sched,
            dtype,
            spec.max_cached_pages,
            weights=weights,
            host=host,
            pinned=spec.pinned or self.policy.all_resident,
            keep_alive_s=spec.keep_alive_s,
            resources=dev.resources,
            ttft_slo_s=spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None,
            tpot_slo_s=spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None,
            profile_budget_s=self._profile_budget() if profile else 0.0,
            **shards,
        )

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
        for w in self.workers:
            snap = w.snapshot_now() if now else w.snapshot
            m = snap.model(name)
            if m is not None:
                return m
        return None

    def submit(
        self,
        served: ServedModel,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None] | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request already checked by `served.check` (thread-safe). Its id is new and
        internal: never a client's."""
        rid = f"r{next(self._ids)}"
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = Request(rid, prompt_ids, params, served.eos_token_ids, arrival, sink)
        self._send(served.name, Submit(served.name, req))
        return req

    def _send(self, model: str, cmd) -> None:
        """A command for a model's device (held while the model moves to another)."""
        with self._route:
            held = self._moving.get(model)
            if held is not None:
                held.append(cmd)
            elif model in self._where:
                self._where[model].send(cmd)

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
        self._send(model, Abort(model, request_id))

    def activate(self, name: str) -> float:
        """Make a model resident now (thread-safe; blocks until done); returns the seconds the
        transition took. TransitionRefused if it cannot be done now."""
        self.model(name)
        t = time.perf_counter()
        self._settled(name).execute(Activate(name))
        return time.perf_counter() - t

    def evict(self, name: str, drain_s: float | None = None) -> float:
        """Offload a model (thread-safe; blocks until done): its running requests may finish for
        up to drain_s seconds (default: its drain_timeout_s), the rest are requeued; returns the
        seconds the transition took. TransitionRefused for a pinned model."""
        served = self.model(name)
        t = time.perf_counter()
        drain = served.spec.drain_timeout_s if drain_s is None else drain_s
        self._settled(name).execute(Evict(name, drain))
        return time.perf_counter() - t

    def _settled(self, name: str) -> DeviceWorker:
        """The device of a model that is not moving (an admin transition waits for none)."""
        with self._route:
            if name in self._moving:
                raise TransitionRefused(f"`{name}` is moving to another device; retry")
            return self._where[name]

    # ---- moving a model to another device ------------------------------------------------------
    def migrate(self, name: str, device: str) -> bool:
        """Move an offloaded model to `device` (the planner placed it there): it is built there
        from its host copy and is resident there; requests sent meanwhile wait and then go
        there. False if it cannot move now: it has requests, it is not offloaded for room, or
        `device` has not its weight pages free (moving evicts nobody), or it is split over
        several devices (it stays on them)."""
        served = self.served.get(name)
        dst = next((w for w in self._workers if w.name == device), None)
        with self._route:
            src = self._where.get(name)
            if served is None or served.failed or dst is None or src in (None, dst):
                return False
            if served.spec.tensor_parallel > 1:
                return False
            if name in self._moving:
                return False
            self._moving[name] = []
        home, lost = src, None
        try:
            pages = src.call(lambda: _weight_pages(src.models.get(name)))
            if pages is None or not dst.call(lambda: dst.pool.num_available >= pages):
                return False
            old = src.call(lambda: src.detach(name, dst.name))
            if old is None:
                return False
            host = src.call(old.leave_device)  # its pages here go back to this device's pool
            try:
                worker, home = self._rebuild(served, old, host, dst), dst
            except Exception:
                log.exception("moving %s to %s failed: it stays on %s", name, dst.name, src.name)
                try:
                    worker = self._rebuild(served, old, host, src)
                except Exception as e:
                    log.exception("model %s was lost moving to another device", name)
                    lost = f"{type(e).__name__}: {e}"
                    return False
            home.execute(AddModel(worker))
            return home is dst
        finally:
            with self._route:
                self._where[name] = home
                if lost is not None:
                    self.served[name] = replace(served, error=lost)
                elif home is not src:
                    self.served[name] = replace(served, device=home.name)
                held = self._moving.pop(name)
                if lost is None:
                    for cmd in held:
                        home.send(cmd)
            if lost is not None:  # what was sent meanwhile ends with the error
                for cmd in held:
                    if isinstance(cmd, Submit) and cmd.request.sink is not None:
                        cmd.request.sink(_failed(cmd.request, lost))

    def _rebuild(
        self, served: ServedModel, old: ModelWorker, host: HostCopy, dev: DeviceWorker
    ) -> ModelWorker:
        """`old`'s model on dev: its weights mapped in dev's pool and copied in from the host
        copy, a runner and graphs of its own there; the history of `old` carried over."""
        device = dev.pool.backend.device
        model0 = old.runner.model
        dtype = next(model0.parameters()).dtype
        box: dict = {}

        def place(tensors):
            wb = box["weights"] = WeightBuffer(
                dev.pool, f"{served.name}/weights", WeightLayout.pack(tensors)
            )
            if not dev.call(wb.map):
                raise MemoryError(f"{dev.name} has not the pages of {served.name}'s weights")
            return wb.views()

        try:
            with _current(device):
                model = empty_model(model0.config, dtype, device, place)
                host.retarget(device)
                host.load(box["weights"].bytes())
                # built on dev's engine thread, between its steps: the runner's graph warm-ups
                # and kernels' warm-up use the device's workspaces, which its models' steps use
                worker = dev.call(
                    lambda: self._worker(
                        served.spec,
                        model,
                        old.outputs.tokenizer,
                        dev,
                        old.scheduler.config,
                        old.kv.layout.dtype,
                        box["weights"],
                        host,
                        profile=False,  # its latency model comes with its history (inherit)
                    )
                )
        except BaseException:
            if "weights" in box:
                dev.call(box["weights"].close)
            raise
        worker.inherit(old)
        return worker

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
            w.call(lambda w=w: [m.check_integrity() for m in w.models.values()])
            w.pool.check_integrity()

    def close(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.stop()
        for name, served in list(self.served.items()):
            if not served.failed and name in self._where:
                self._where.pop(name).execute(RemoveModel(name))
            del self.served[name]
        for w in self._workers:
            w.stop()
            w.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _devices(device: torch.device, n: int) -> list[torch.device]:
    """The devices of an engine of n: on CUDA, GPUs 0 .. n-1 (one GPU: the configured one);
    on the host, n emulated devices."""
    if device.type != "cuda":
        return [device] * n
    have = torch.cuda.device_count()
    if n > have:
        raise ValueError(f"devices = {n}, but this machine has {have} CUDA device(s)")
    return [device] if n == 1 else [torch.device("cuda", i) for i in range(n)]


def _current(device: torch.device):
    """A context in which `device` is the current CUDA device (graphs are captured and streams
    made on the current one); nothing on the host."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _weight_pages(m: ModelWorker | None) -> int | None:
    """The pages of an evictable model's weights (None: it has none of its own to move)."""
    return m.weights.num_pages if m is not None and m.weights is not None else None


def _failed(req: Request, error: str) -> RequestOutput:
    return RequestOutput(
        req.request_id, [], "", None, True, FinishReason.ERROR, req.num_prompt_tokens, 0, error
    )
