"""The LoRA half of a ModelWorker: its base's adapters (adapters.py's BaseAdapters, None until
the first is loaded) as its step sees them. An adapter's requests are the worker's own, tagged
with the adapter's name (Request.adapter): a request is refused when its adapter is gone, the
step admits only the requests whose adapter is ready (resident, in a slot), an adapter is
unloaded once its requests are done, and an offloaded base has every adapter evicted."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prism_server.engine.adapters import BaseAdapters
from prism_server.engine.output_processor import OutputProcessor
from scheduler.batch_scheduler import BatchScheduler
from scheduler.request import FinishReason, Request
from scheduler.snapshot import ModelSnapshot


class ModelAdapters:
    """A ModelWorker's adapters. It reads the worker's `scheduler`, `requests` and `outputs`,
    and calls `sync` (no step in flight reads an adapter's pages) and `_emit`: the worker
    provides them. Before ModelResidency and ModelStats among the worker's bases: its `poll`,
    `_offload` and `snapshot` extend theirs. Engine thread only."""

    name: str
    scheduler: BatchScheduler
    requests: dict[str, Request]
    outputs: OutputProcessor

    def __init__(self):
        # its LoRA adapters (None until the first is loaded): their requests are its own,
        # tagged with the adapter's name (Request.adapter)
        self.adapters: BaseAdapters | None = None
        self._starving = False  # blocked on memory with nothing running, since the last step

    def _accept_adapter(self, req: Request) -> bool:
        """Counts a new request of an adapter; False (the request ended with the reason) if the
        adapter was unloaded after the request was accepted."""
        a = self.adapters.by_name.get(req.adapter) if self.adapters is not None else None
        if a is None:
            out = self.outputs.final(
                req, FinishReason.ERROR, f"the adapter {req.adapter} is not loaded"
            )
            self._emit(req, out)
            return False
        a.requests_total += 1
        return True

    def _admit_adapters(self, admit: Sequence[str] | None, now: float) -> Sequence[str] | None:
        """The pick's admission (None: FCFS) less the waiting requests whose adapter cannot run
        in this step (its pages or a slot not to be had now); their adapters are made ready
        (resident, in a slot), the running requests' first."""
        if not self.adapters:
            return admit
        s = self.scheduler
        running = {r.adapter for r in s.running if r.adapter is not None}
        mine = self.requests
        order = list(s.waiting) if admit is None else [mine[i] for i in admit if i in mine]
        wanted = [*running, *(r.adapter for r in order if r.adapter is not None)]
        # blocked on memory with nothing running (until something runs): the adapter of the
        # first request in line (FCFS, whatever the pick) alone is made ready, so that the pages
        # its KV needs are not taken by adapters of requests behind it (parked_adapters)
        self._starving = not s.running and (s.blocked or self._starving)
        if not wanted:
            return admit
        head = self._head() if self._starving else ""
        ready = self.adapters.prepare(wanted, running, now, head)
        if running - ready:  # never: a running request's adapter keeps its pages and slot
            raise RuntimeError(f"adapters of running requests not ready: {sorted(running - ready)}")
        if all(r.adapter is None or r.adapter in ready for r in order):
            return admit
        return [r.request_id for r in order if r.adapter is None or r.adapter in ready]

    def parked_adapters(self) -> list:
        """While nothing of it runs: its resident adapters (their requests all wait) but for
        the first request's in line, least recently used first: pages its blocked work may
        take (they come back by a copy at their requests' turn). Empty while something runs
        (its requests end and free pages)."""
        if not self.adapters or self.scheduler.running:
            return []
        return [a for a in self.adapters.idle(set()) if a.name != self._head()]

    def _head(self) -> str | None:
        """The adapter of the first request waiting (None: the base's own, or none)."""
        return next((r.adapter for r in self.scheduler.waiting), None)

    def busy_adapters(self) -> set[str]:
        """The adapters some request of this model runs with or waits for."""
        return {r.adapter for r in self.requests.values() if r.adapter is not None}

    @property
    def adapters_loading(self) -> bool:
        """Whether an adapter's activation copy is in flight (its requests wait for it)."""
        return bool(self.adapters) and bool(self.adapters.loading)

    @property
    def adapter_pages(self) -> int:
        """The pool pages its adapters hold now."""
        if not self.adapters:
            return 0
        return sum(a.buffer.pages.num_mapped_pages for a in self.adapters.by_name.values())

    def evict_adapter(self, name: str) -> int:
        """Give an idle adapter's pages back (its step in flight read first); -> pages freed."""
        self.sync()
        return self.adapters.evict(name)

    def unload_adapter(self, name: str, done) -> None:
        """Drop an adapter once its requests have finished (at once if it has none); `done`
        resolves then. New requests for it are refused meanwhile by the frontend."""
        a = self.adapters.by_name[name] if self.adapters is not None else None
        if a is None:
            raise KeyError(name)
        a.unloading.append(done)
        self.reap_adapters()

    def reap_adapters(self) -> None:
        """Remove the adapters being unloaded whose requests are all done."""
        if not self.adapters:
            return
        gone = [a.name for a in self.adapters.by_name.values() if a.unloading]
        if not gone:
            return
        busy = self.busy_adapters()
        for name in gone:
            if name not in busy:
                self.sync()  # no step in flight reads its pages
                self.adapters.remove(name)

    def poll(self) -> None:
        super().poll()
        self.reap_adapters()

    def _offload(self) -> None:
        super()._offload()
        if self.adapters:  # an offloaded base holds no page: its adapters' go with its own
            self.adapters.evict_all()

    def snapshot(self) -> ModelSnapshot:
        snap = super().snapshot()
        if not self.adapters:
            return snap
        mine = list(self.scheduler.running) + list(self.scheduler.waiting)
        return dataclasses.replace(snap, adapters=self.adapters.snapshot(self.name, mine))
