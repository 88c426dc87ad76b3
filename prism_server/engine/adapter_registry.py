"""The engine's LoRA adapters as served models: loads and unloads at run time (LoadAdapter and
UnloadAdapter commands to the base's device), the lora_dirs resolver, and each adapter's base.
Thread-safe: the frontend, admin calls and the engine thread's callbacks meet here."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from kvpool import HostBudget
from models.lora import AdapterError, read_adapter_config
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import LoadAdapter, Submit, UnloadAdapter
from prism_server.engine.routing import Routes
from prism_server.served_model import ModelNotFound, ServedModel

log = logging.getLogger(__name__)


class AdapterRegistry:
    def __init__(
        self,
        config: EngineConfig,
        served: dict[str, ServedModel],
        routes: Routes,
        host: HostBudget | None = None,
    ):
        """served: the engine's served models (an adapter is added once loaded, removed at its
        unload); routes: where each base is served; host: what the adapters' host copies take
        from (None: unbounded)."""
        self.config, self.served, self.routes, self.host = config, served, routes, host
        # each adapter's base (kept after an unload: a late abort finds its model), the loads
        # under way (a second ask for one joins the first), and the unloads (a load of the
        # name waits for its unload: the device holds the adapter until its requests end)
        self._bases: dict[str, str] = {}
        self._loads: dict[str, tuple[Future, str, str]] = {}  # name -> (its future, path, base)
        self._unloads: dict[str, Future] = {}
        self._lock = threading.Lock()

    def start_load(
        self,
        name: str,
        path: str,
        base: str | None = None,
        spec: ModelSpec | None = None,
        join_any: bool = False,
    ) -> Future:
        """Load the LoRA adapter in directory `path` as model `name`, served by the steps of
        `base` (None: the base its adapter_config.json names, or the only base model); returns
        at once. The future -> its ServedModel, or AdapterError (a bad adapter: nothing served
        is disturbed), ValueError (a name taken, or being loaded from another path or for
        another base; join_any: a load of the name under way is joined whatever it loads, as a
        request naming the adapter wants)."""
        with self._lock:
            pending = self._loads.get(name)
            if pending is not None:  # the same name asked twice at once: one load
                out, was_path, was_base = pending
                if join_any or (was_path, was_base) == (str(path), base or was_base):
                    return out
                raise ValueError(
                    f"adapter {name!r} is being loaded from {was_path} for {was_base!r}"
                )
            if name in self.served:
                raise ValueError(f"a model named {name!r} is already loaded")
            base = base or self._base_of(name, path)
            served_base = self.served.get(base)
            if served_base is None or served_base.spec.is_adapter:
                raise AdapterError(f"adapter {name}: its base {base!r} is not a served model")
            if served_base.failed:
                raise AdapterError(f"adapter {name}: its base {base!r} failed to load")
            if served_base.spec.tensor_parallel > 1:
                raise AdapterError(
                    f"adapter {name}: its base {base!r} is split over devices "
                    "(tensor_parallel > 1), which adapters do not run on"
                )
            spec = spec or ModelSpec(name, base=base, adapter=str(path))
            cfg = self.config
            cmd = LoadAdapter(base, name, str(path), cfg.max_lora_rank, cfg.max_loras, self.host)
            out: Future = Future()
            self._loads[name] = (out, str(path), base)
            unloading = self._unloads.get(name)

        def loaded(done: Future) -> None:  # (on the engine thread)
            with self._lock:
                self._loads.pop(name, None)
                e = done.exception()
                if e is None:
                    self._bases[name] = base
                    self.served[name] = got = replace(served_base, spec=spec)
            if e is not None:
                out.set_exception(e)
                return
            log.info("adapter %s of %s loaded from %s", name, base, path)
            # answered once a snapshot shows it (a model list read then has its state)
            self.routes.after_publish(base, lambda: out.set_result(got))

        cmd.done.add_done_callback(loaded)
        if unloading is None:
            self.routes.send(base, cmd)
        else:  # sent once the unload is done (at once if it is: not under the lock)
            unloading.add_done_callback(lambda _: self.routes.send(base, cmd))
        return out

    def start_unload(self, name: str) -> Future:
        """Stop serving adapter `name`: new requests for it get 404 at once, those accepted
        finish; returns at once. The future resolves once it is gone (its pages and host copy
        freed). ModelNotFound if no such adapter. A load of the name meanwhile waits for it."""
        with self._lock:
            served = self.served.get(name)
            if served is None or not served.spec.is_adapter:
                raise ModelNotFound(name)
            del self.served[name]
            if served.failed:  # it never reached a device: nothing there to free
                gone: Future = Future()
                gone.set_result(None)
                return gone
            cmd = UnloadAdapter(served.spec.base, name)
            self._unloads[name] = cmd.done
            # sent under the lock, as requests are (`submit`): one sent before it finishes
            self.routes.send(served.spec.base, cmd)

        def unloaded(done: Future) -> None:  # (on the engine thread)
            with self._lock:
                if self._unloads.get(name) is done:
                    del self._unloads[name]

        cmd.done.add_done_callback(unloaded)
        return cmd.done

    def submit(self, name: str, cmd: Submit) -> None:
        """Send a request of adapter `name` to its base's device, unless the adapter is no
        longer served (ModelNotFound: unloaded since the request looked it up). Under the lock
        an unload takes, so a request either reaches the device before the unload (and
        finishes: the adapter stays until its requests end) or is refused here."""
        with self._lock:
            if name not in self.served:
                raise ModelNotFound(name)
            self.routes.send(cmd.model, cmd)

    def find(self, name: str) -> Path | None:
        """The directory of an adapter called `name` in lora_dirs (<dir>/<name> with an
        adapter_config.json), or None."""
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return None
        for d in self.config.lora_dirs:
            path = Path(d).expanduser() / name
            if (path / "adapter_config.json").is_file():
                return path
        return None

    def device_model(self, name: str) -> str:
        """The model whose device worker serves `name`: an adapter's base, else `name`."""
        return self._bases.get(name, name)

    def _base_of(self, name: str, path: str) -> str:
        """The base of an adapter loaded at run time: the served base model its config's
        base_model_name_or_path names (by name, or its source's path), else the only one."""
        bases = {n: s for n, s in self.served.items() if not s.spec.is_adapter and not s.failed}
        named = str(read_adapter_config(path, name).get("base_model_name_or_path") or "")
        if named:
            for n, s in bases.items():
                src = s.spec.source
                if named in (n, src) or Path(named).name in (n, Path(src).name):
                    return n
        if len(bases) == 1:
            return next(iter(bases))
        raise AdapterError(
            f"adapter {name}: which base model it adapts is not known (its "
            f"base_model_name_or_path is {named!r}; served: {sorted(bases)}); name it"
        )
