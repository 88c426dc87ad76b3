"""The engine: the process facade. It builds each device's page pool and worker thread, loads the
configured models onto them, keeps one ServedModel per model for the frontend, and hands requests
to the right device as typed commands. `generate` is the synchronous convenience API."""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from kvpool import HostCopy, PagePool, WeightBuffer, WeightLayout
from models.embedded import resolve_source
from models.loader import ModelSource, load_model
from prism_server import envs
from prism_server.commands import Abort, Activate, AddModel, Evict, RemoveModel, Submit
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.control_loop import ControlLoop, PlanView
from prism_server.device_worker import DeviceWorker
from prism_server.memory_budget import check_host_budget, make_backend, pool_budget
from prism_server.model_worker import ModelWorker
from prism_server.served_model import ModelFailed, ModelNotFound, ServedModel
from scheduler.policy import policy, static_quota
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
        if self.device.type == "cpu" and envs.cpu_threads():
            torch.set_num_threads(envs.cpu_threads())
        check_host_budget(config, self.device)
        budget = pool_budget(config, self.device)
        # On a GPU the pool creates every handle now (creating is the slow driver call) and
        # keeps them; on the host it creates them on demand.
        precreate = budget // config.page_bytes if self.device.type == "cuda" else 0
        self.pool = PagePool(
            make_backend(self.device, config.memory_backend),
            config.page_bytes,
            budget,
            precreate,
        )
        self.policy = policy(config.policy)
        self.worker = DeviceWorker(self.pool, self.policy)
        self.worker.start()
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
        return b if b is not None else (1.0 if self.device.type == "cuda" else 0.25)

    def _partition(self) -> None:
        """static: the KV room the weights leave, split into fixed equal quotas that are never
        reclaimed (each model keeps what it maps)."""
        loaded = [n for n, s in self.served.items() if not s.failed]

        def split() -> int:
            ws = [self.worker.models[n] for n in loaded]
            quota = static_quota(self.pool.capacity, [w.weights.num_pages for w in ws])
            for w in ws:
                w.kv.allocator.set_quota(quota)
                w.kv.allocator.max_cached_pages = quota
            return quota

        quota = self.worker.call(split)
        if loaded and quota < 1:
            self.close()
            raise MemoryError(
                f"the static policy needs every model resident with KV room: the weights of "
                f"{', '.join(loaded)} leave no page of the {self.pool.capacity} in the pool"
            )
        for n in loaded:
            w = self.worker.models[n]
            s = self.served[n]
            self.served[n] = replace(s, max_kv_tokens=w.max_kv_tokens)
        log.info("static partition: %d KV pages for each of %d models", quota, len(loaded))

    @property
    def workers(self) -> list[DeviceWorker]:
        return [self.worker]

    def load(self, spec: ModelSpec) -> ServedModel:
        """Load a model into the pool (its weights in pool pages, a host copy beside them). Idle
        models are evicted while it loads if the pool needs their pages; it then stays resident
        only if they fit back without it (config order wins), else it is offloaded."""
        if spec.name in self.served:
            raise ValueError(f"a model named {spec.name!r} is already loaded")
        dtype = spec.torch_dtype(self.device)
        box: dict = {}

        def place(tensors):
            wb = box["weights"] = WeightBuffer(
                self.pool, f"{spec.name}/weights", WeightLayout.pack(tensors)
            )
            box["evicted"] = self.worker.call(
                lambda: self.worker.make_room(wb.can_map, time.monotonic())
            )
            if box["evicted"] and self.policy.all_resident:
                raise MemoryError(
                    f"the static policy keeps every model resident, and {spec.name} does not "
                    f"fit beside {', '.join(self.served)}; raise pool_budget_bytes"
                )
            if not self.worker.call(wb.map):
                raise MemoryError(
                    f"the page pool ({self.pool.capacity} pages of {self.pool.page_bytes} bytes) "
                    f"cannot hold the {wb.nbytes} bytes of {spec.name}'s weights; raise "
                    "pool_budget_bytes"
                )
            return wb.views()

        try:
            loaded = load_model(
                ModelSource.parse(resolve_source(spec.source)),
                dtype=dtype,
                device=self.device,
                seed=spec.seed,
                cache_root=envs.gguf_cache_dir(),
                fused_kernels=envs.fused_kernels(),
                place=place,
            )
            cfg, tok = loaded.config, loaded.tokenizer
            reserve = self.config.reserve_output_tokens
            if reserve is None:
                reserve = self.policy.reserve_output_tokens
            sched = spec.scheduler_config(cfg.max_position_embeddings, reserve)
            weights = box["weights"]
            host = HostCopy(weights.nbytes, self.device)
            host.save(weights.bytes())
            worker = ModelWorker(
                spec.name,
                loaded.model,
                tok,
                self.pool,
                sched,
                dtype,
                spec.max_cached_pages,
                weights=weights,
                host=host,
                pinned=spec.pinned or self.policy.all_resident,
                keep_alive_s=spec.keep_alive_s,
                resources=self.worker.resources,
                ttft_slo_s=spec.ttft_slo_ms / 1e3 if spec.ttft_slo_ms else None,
                tpot_slo_s=spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None,
                profile_budget_s=self._profile_budget(),
            )
        except BaseException:
            if "weights" in box:
                self.worker.call(box["weights"].close)
            for name in box.get("evicted", ()):  # as it was before this load
                self.worker.execute(Activate(name))
            raise
        self.worker.execute(AddModel(worker))
        if box["evicted"]:  # earlier models first: this one waits offloaded
            self.worker.execute(Evict(spec.name))
            for name in box["evicted"]:
                self.worker.execute(Activate(name))
        eos = frozenset(cfg.eos_token_ids)
        if tok.eos_token_id is not None:
            eos |= {tok.eos_token_id}
        served = ServedModel(
            spec,
            device=str(self.device),
            tokenizer=tok,
            max_model_len=sched.max_model_len,
            max_kv_tokens=worker.max_kv_tokens,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos,
        )
        self.served[spec.name] = served
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
        self.worker.send(Submit(served.name, req))
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
        self.worker.send(Abort(model, request_id))

    def activate(self, name: str) -> float:
        """Make a model resident now (thread-safe; blocks until done); returns the seconds the
        transition took. TransitionRefused if it cannot be done now."""
        self.model(name)
        t = time.perf_counter()
        self.worker.execute(Activate(name))
        return time.perf_counter() - t

    def evict(self, name: str, drain_s: float | None = None) -> float:
        """Offload a model (thread-safe; blocks until done): its running requests may finish for
        up to drain_s seconds (default: its drain_timeout_s), the rest are requeued; returns the
        seconds the transition took. TransitionRefused for a pinned model."""
        served = self.model(name)
        t = time.perf_counter()
        drain = served.spec.drain_timeout_s if drain_s is None else drain_s
        self.worker.execute(Evict(name, drain))
        return time.perf_counter() - t

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
        self.pool.check_integrity()

    def close(self) -> None:
        if getattr(self, "control", None) is not None:
            self.control.stop()
        for name, served in list(self.served.items()):
            if not served.failed:
                self.worker.execute(RemoveModel(name))
            del self.served[name]
        self.worker.stop()
        self.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
