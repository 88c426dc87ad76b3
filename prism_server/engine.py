"""The engine: loads models onto a device, shares the device's page pool among them, and runs
requests on the device's engine thread. `generate` is the synchronous convenience API."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvpool import CpuBackend, CudaBackend, MemoryBackend, PagePool
from models.config import ModelConfig
from models.embedded import resolve_source
from models.loader import ModelSource, load_model
from models.presets import get_preset
from models.registry import get_model_class
from prism_server import envs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.device_engine import DeviceEngine
from prism_server.model_engine import ModelEngine
from prism_server.request import FinishReason, Request, RequestOutput, TokenLogprob
from prism_server.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_CPU_DEFAULT_BUDGET = 2 << 30
# GPU memory kept out of the default KV budget beyond the configured models' weights: activations,
# FlashInfer workspaces, CUDA graph pools, cuBLAS workspaces, the allocator's slack.
_GPU_RESERVE_FRACTION = 0.08
_GPU_MIN_RESERVE = 4 << 30


class ModelFailed(RuntimeError):
    """A configured model that could not be loaded; requests for it get this error."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"The model `{name}` failed to load: {reason}")
        self.name, self.reason = name, reason


class ModelNotFound(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model `{self.name}` does not exist."


@dataclass
class Completion:
    """The whole result of one request (the synchronous API's answer)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.logprobs or []
        if out.finished:
            self.finish_reason, self.finish_time, self.error = out.finish_reason, now, out.error


def make_backend(device: torch.device) -> MemoryBackend:
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        return CudaBackend(device)
    raise NotImplementedError(f"no page-pool backend for device {device}")


def weight_bytes(spec: ModelSpec, device: torch.device) -> int:
    """Parameter bytes of `spec` at its serving dtype, counted on a meta-device build of its
    config (nothing is allocated or read beyond config.json; a GGUF file is converted, as its
    load would do next anyway)."""
    src = ModelSource.parse(resolve_source(spec.source))
    if src.kind == "dummy":
        cfg = ModelConfig.from_hf(get_preset(src.path))
    else:
        path = Path(src.path)
        if src.kind == "gguf":
            from models.gguf_convert import convert_gguf

            path = convert_gguf(path)
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = get_model_class(cfg.hf_architecture)(cfg)
    return sum(p.numel() for p in model.parameters()) * spec.torch_dtype(device).itemsize


def default_kv_budget(device: torch.device, specs: tuple[ModelSpec, ...] = ()) -> int:
    """The page pool's budget when neither EngineConfig.kv_budget_bytes nor PRISM_KV_BUDGET_BYTES
    sets one. CPU: 2 GiB. CUDA: the device's free memory when the engine starts, minus the weights
    of the models the config names (they load after the pool is made), minus a reserve of
    max(4 GiB, 8% of the device) for activations, workspaces and graphs. Models loaded later must
    fit in that reserve, or set the budget explicitly."""
    if device.type != "cuda":
        return _CPU_DEFAULT_BUDGET
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(_GPU_MIN_RESERVE, int(total * _GPU_RESERVE_FRACTION))
    weights = 0
    for s in specs:
        try:
            weights += weight_bytes(s, device)
        except Exception:  # a model that cannot even be sized fails (and is reported) at load
            continue
    budget = free - weights - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for KV: {free / 2**30:.1f} GiB free, weights "
            f"{weights / 2**30:.1f} GiB, reserve {reserve / 2**30:.1f} GiB; set kv_budget_bytes"
        )
    return budget


class Engine:
    def __init__(self, config: EngineConfig | None = None, strict: bool = True):
        """strict: a model that fails to load raises; otherwise it is marked failed (see
        `failed`) and the other models are served."""
        self.config = config = config or EngineConfig()
        self.device = config.torch_device()
        if self.device.type == "cpu" and envs.cpu_threads():
            torch.set_num_threads(envs.cpu_threads())
        budget = (
            config.kv_budget_bytes
            or envs.kv_budget_bytes()
            or default_kv_budget(self.device, config.models)
        )
        # On a GPU the pool creates every handle now (creating is the slow driver call) and
        # keeps them; on the host it creates them on demand.
        precreate = budget // config.page_bytes if self.device.type == "cuda" else 0
        self.pool = PagePool(make_backend(self.device), config.page_bytes, budget, precreate)
        self.device_engine = DeviceEngine(self.pool)
        self.device_engine.start()
        self.models: dict[str, ModelEngine] = {}
        self.failed: dict[str, str] = {}  # model name -> why it could not be loaded
        self._ids = itertools.count()
        for spec in config.models:
            try:
                self.load(spec)
            except Exception as e:
                if strict:
                    self.close()
                    raise
                log.error("model %s failed to load: %s", spec.name, e)
                self.failed[spec.name] = f"{type(e).__name__}: {e}"

    def load(self, spec: ModelSpec) -> ModelEngine:
        if spec.name in self.models:
            raise ValueError(f"a model named {spec.name!r} is already loaded")
        dtype = spec.torch_dtype(self.device)
        loaded = load_model(
            ModelSource.parse(resolve_source(spec.source)),
            dtype=dtype,
            device=self.device,
            seed=spec.seed,
        )
        cfg = loaded.config
        engine = ModelEngine(
            spec.name,
            loaded.model,
            loaded.tokenizer,
            cfg,
            self.pool,
            spec.scheduler_config(cfg.max_position_embeddings),
            dtype,
            spec.max_cached_pages,
        )
        self.device_engine.add_model(engine)
        self.models[spec.name] = engine
        return engine

    def model(self, name: str) -> ModelEngine:
        try:
            return self.models[name]
        except KeyError:
            if name in self.failed:
                raise ModelFailed(name, self.failed[name]) from None
            raise ModelNotFound(name) from None

    def encode(self, model: str, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.model(model).tokenizer(prompt).input_ids)
        return list(prompt)

    def add_request(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queues a request (thread-safe). Raises ModelNotFound or ValueError (bad request)."""
        me = self.model(model)
        ids = self.encode(model, prompt)
        me.check_request(len(ids), params.max_tokens)
        rid = request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        req = Request(rid, ids, params, me.eos_token_ids, sink)
        self.device_engine.submit(model, req)
        return req

    def abort(self, model: str, request_id: str) -> None:
        self.device_engine.abort(model, request_id)

    def generate(
        self, model: str, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[Completion]:
        """Runs all prompts concurrently and waits for them."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        results: dict[str, Completion] = {}
        for p in prompts:
            holder: dict = {}

            def sink(out: RequestOutput, holder=holder) -> None:
                holder["c"].add(out)
                if out.finished:
                    done.put(out.request_id)

            req_ids = self.encode(model, p)
            c = Completion("", req_ids, arrival_time=time.monotonic())
            holder["c"] = c
            req = self.add_request(model, req_ids, params, sink)
            c.request_id = req.request_id
            results[req.request_id] = c
        order = list(results)
        for _ in order:
            done.get()
        return [results[r] for r in order]

    def check_integrity(self) -> None:
        """Pool and every model's KV accounting are exact (call when the engine is idle)."""
        models = list(self.models.values())
        self.device_engine._call(lambda: [m.kv_cache.check_integrity() for m in models])
        self.pool.check_integrity()

    def close(self) -> None:
        for name in list(self.models):
            self.device_engine.remove_model(name)
            del self.models[name]
        self.device_engine.stop()
        self.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
