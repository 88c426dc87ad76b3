"""The engine: the process facade. It builds each device's page pool and worker thread, loads the
configured models onto them (Load commands: each device's thread builds its models), keeps one
ServedModel per model for the frontend, and hands requests and moves to the right device as typed
commands. `generate` is the synchronous convenience API."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import torch

from kvpool import PagePool
from models.attention.flashinfer_paged import DEFAULT_KERNELS, KernelChoice
from models.layers.triton_gemv import GemvConfig
from models.layers.triton_small_gemm import SmallGemmConfig
from prism_server import envs, gpu_setup
from prism_server.commands import (
    Abort,
    Activate,
    Detach,
    Evict,
    Load,
    Migrate,
    Partition,
    RemoveModel,
    Submit,
    TransitionRefused,
)
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.control_loop import ControlLoop, PlanView
from prism_server.device_worker import DeviceWorker
from prism_server.grammar import Grammars
from prism_server.loading import Loaded, LoadSettings
from prism_server.memory_budget import check_host_budget, make_backend, pool_budget, weight_bytes
from prism_server.served_model import ModelFailed, ModelNotFound, ServedModel
from scheduler.planner import DeviceCapacity, ModelDemand, plan
from scheduler.policy import policy
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
        if self.device.type == "cpu" and envs.cpu_threads():
            torch.set_num_threads(envs.cpu_threads())
        devices = _devices(self.device, config.devices)
        for d in devices:  # MissingPackage: cannot run here
            gpu_setup.report(d, config.memory_backend)
        check_host_budget(config, self.device)
        self.policy = policy(config.policy)
        splits, stages, waves, wide_tile, pdl, warps = envs.triton_decode()
        cuda = self.device.type == "cuda"
        small = envs.triton_small_gemm(torch.cuda.get_device_name(self.device) if cuda else "")
        kernels = KernelChoice(
            decode_tensor_cores=envs.decode_tensor_cores(),
            prefill_backend=envs.prefill_backend(),
            prefill_backend_min_tokens=envs.prefill_backend_min_tokens(),
            ragged_prefill=envs.ragged_prefill(),
            decode_split_pages=envs.decode_split_pages(),
            decode_backend=envs.decode_backend(),
            fused_rope_write=envs.fused_rope_write(),
            decode_backend_max_batch=envs.decode_backend_max_batch(),
            triton_max_splits=splits,
            triton_stages=stages,
            triton_waves=waves,
            triton_wide_tile=wide_tile,
            triton_warps=warps,
            triton_dense=envs.triton_dense(DEFAULT_KERNELS.triton_dense),
            triton_pdl=pdl,
            l2_prefetch_mib=envs.l2_prefetch_mib(),
            l2_prefetch_inline=envs.l2_prefetch_inline(),
            l2_prefetch_keep=envs.l2_prefetch_keep(),
            triton_step_ops=envs.triton_step_ops(),
            triton_gemv=None if (gemv := envs.triton_gemv()) is None else GemvConfig(*gemv),
            triton_gemv_glu=envs.triton_gemv_glu(),
            triton_small_gemm=None if small is None else SmallGemmConfig.parse(small),
        )
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
                trace=envs.step_trace(),
                kernels=kernels,
                launch_ahead=envs.launch_ahead(),
                piecewise=envs.piecewise_graphs(),
                piecewise_tokens=envs.piecewise_max_tokens(),
                lanes=envs.decode_lanes(),
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
        reserve = config.reserve_output_tokens
        self._settings = LoadSettings(
            cache_root=envs.gguf_cache_dir(),
            fused_kernels=envs.fused_kernels(),
            reserve_output_tokens=self.policy.reserve_output_tokens if reserve is None else reserve,
            enable_prefix_caching=config.enable_prefix_caching,
            profile_budget_s=config.profile_budget_s
            if config.profile_budget_s is not None
            else (2.5 if self.device.type == "cuda" else 0.25),
            all_resident=self.policy.all_resident,
        )
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

    def _partition(self) -> None:
        """static: the KV room the weights leave, split into fixed equal quotas that are never
        reclaimed (each model keeps what it maps)."""
        for dev in self._workers:
            quota, max_kv = dev.execute(Partition())
            if max_kv and quota < 1:
                self.close()
                raise MemoryError(
                    f"the static policy needs every model resident with KV room: the weights of "
                    f"{', '.join(max_kv)} leave no page of the {dev.pool.capacity} in the pool "
                    f"of {dev.name}"
                )
            for n, tokens in max_kv.items():
                self.served[n] = replace(self.served[n], max_kv_tokens=tokens)
            log.info(
                "static partition on %s: %d KV pages for each of %d models",
                dev.name,
                quota,
                len(max_kv),
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
        only if they fit back without it (config order wins), else it is offloaded. A model
        split over spec.tensor_parallel devices goes to the one the planner picks and the next
        ones (each shard's weights in its device's pool; the first device's thread steps it);
        it is evicted and activated like any model, never moved to other devices."""
        if spec.name in self.served:
            raise ValueError(f"a model named {spec.name!r} is already loaded")
        n = spec.tensor_parallel
        if n > len(self._workers):
            raise ValueError(
                f"{spec.name}: tensor_parallel = {n}, but the engine has {len(self._workers)} "
                "device(s) (set devices)"
            )
        dev = self._device_for(spec)
        i = self._workers.index(dev)
        shards = tuple((self._workers[i:] + self._workers[:i])[1:n])
        loaded: Loaded = dev.execute(Load(spec, self._settings, shards))
        if loaded.evicted:  # earlier models first: this one waits offloaded
            dev.execute(Evict(spec.name))
            for name in loaded.evicted:
                dev.execute(Activate(name))
        cfg, tok = loaded.config, loaded.tokenizer
        eos = frozenset(cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos |= {tok.eos_token_id}
        self._where[spec.name] = dev
        self.served[spec.name] = served = ServedModel(
            spec,
            device=dev.name,
            tokenizer=tok,
            max_model_len=loaded.max_model_len,
            max_kv_tokens=loaded.max_kv_tokens,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos,
            grammars=Grammars(tok, cfg.vocab_size, eos),
        )
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
        t = time.perf_counter()
        self.start_activate(name).result()
        return time.perf_counter() - t

    def evict(self, name: str, drain_s: float | None = None) -> float:
        """Offload a model (thread-safe; blocks until done): its running requests may finish for
        up to drain_s seconds (default: its drain_timeout_s), the rest are requeued; returns the
        seconds the transition took. TransitionRefused for a pinned model."""
        t = time.perf_counter()
        self.start_evict(name, drain_s).result()
        return time.perf_counter() - t

    def start_activate(self, name: str) -> Future:
        """Send a model's activation (thread-safe; returns at once): the future resolves once it
        serves, or with TransitionRefused."""
        self.model(name)
        cmd = Activate(name)
        self._settled(name).send(cmd)
        return cmd.done

    def start_evict(self, name: str, drain_s: float | None = None) -> Future:
        """Send a model's eviction (as `evict`; returns at once): the future resolves once it is
        offloaded, or with TransitionRefused (pinned, or activated while it drained)."""
        served = self.model(name)
        cmd = Evict(name, served.spec.drain_timeout_s if drain_s is None else drain_s)
        self._settled(name).send(cmd)
        return cmd.done

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
            if served.spec.tensor_parallel > 1 or name in self._moving:
                return False
            self._moving[name] = []
        home, lost = src, None
        try:
            moved = src.execute(Detach(name, dst.name, dst.pool))
            if moved is None:
                return False
            try:
                dst.execute(Migrate(served.spec, self._settings, *moved))
                home = dst
            except Exception:
                log.exception("moving %s to %s failed: it stays on %s", name, dst.name, src.name)
                try:
                    src.execute(Migrate(served.spec, self._settings, *moved))
                except Exception as e:
                    log.exception("model %s was lost moving to another device", name)
                    lost = f"{type(e).__name__}: {e}"
                    return False
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


def _failed(req: Request, error: str) -> RequestOutput:
    return RequestOutput(
        req.request_id, [], "", None, True, FinishReason.ERROR, req.num_prompt_tokens, 0, error
    )
