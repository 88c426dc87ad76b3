"""The control loop: every few hundred milliseconds it reads the device snapshots, updates each
model's request rate (from the arrival counters the snapshots carry), runs the KVPR planner, and
sends its moves to the device workers as commands (PlanEvict, Prefetch; Migrate through
`Engine.migrate`):

- a resident model the plan offloads, and that has no request, is evicted (its pages go to the
  models with demand before their requests have to wait for them);
- an offloaded model the plan places, that has demand and was evicted for room (not by an admin
  or its keep-alive), is activated ahead of its next request when its device has the room free
  (it evicts nobody: a request would);
- such a model the plan places on another device moves there (`Engine.migrate`: built there
  from its host copy, when that device has its weight pages free), after the round's other
  moves are sent.

It decides nothing itself (scheduler.planner does) and touches no engine-thread object: snapshots
in, commands out. `tick(now)` is one round, callable directly (tests)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from prism_server.engine.commands import PlanEvict, Prefetch
from prism_server.engine.model_stats import SLO_SCALE
from scheduler.planner import DeviceCapacity, ModelDemand, Placement, RateTracker, plan
from scheduler.snapshot import ModelSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanView:
    """The last plan, for /metrics and the status view."""

    time: float
    placement: Placement
    rates: dict[str, float]  # requests/s
    demand: dict[str, float]  # rate / TTFT SLO
    weights: dict[str, float]  # the bytes each model's placement holds (its adapters' too)


def adapter_bytes(m: ModelSnapshot, page_bytes: int) -> int:
    """The pool bytes of a base's LoRA adapters that its placement must hold beside its own
    weights: those resident or with requests (they run only on its device, in its steps), each
    in whole pages. The planner sees a base and its adapters as one model: their steps are one."""
    return sum(
        -(-a.weight_bytes // page_bytes) * page_bytes
        for a in m.adapters
        if a.resident or a.num_requests
    )


class ControlLoop:
    def __init__(self, engine, interval_s: float, threshold: float = 0.2):
        self.engine = engine
        self.interval_s = interval_s
        self.threshold = threshold
        self.rates = RateTracker()
        self._seen: dict[str, int] = {}
        self.last: PlanView | None = None
        self.moves_sent = 0
        self.migrations = 0  # models moved to another device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prism-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick(time.monotonic())
            except Exception:
                log.exception("the control loop's round failed")

    def tick(self, now: float) -> PlanView:
        workers = {w.name: w for w in self.engine.workers}
        models, devices, current, where = [], [], {}, {}
        snaps = self.engine.snapshots()
        # a split model's shards on other devices hold their memory there, planned or not
        held = {s.device: 0 for s in snaps}
        for snap in snaps:
            for m in snap.models:
                for device, nbytes in m.shard_weight_bytes:
                    held[device] = held.get(device, 0) + nbytes
        for snap in snaps:
            room = snap.pool.capacity * snap.pool.page_bytes - held[snap.device]
            devices.append(DeviceCapacity(snap.device, max(room, 0)))
            for m in snap.models:
                new = m.requests_total - self._seen.get(m.name, 0)
                self._seen[m.name] = m.requests_total
                if new > 0:
                    self.rates.observe(m.name, now, new)
                slo = m.ttft_slo_s or max(SLO_SCALE * m.latency.prefill_1k_s, 1e-3)
                own = m.weight_bytes - sum(b for _, b in m.shard_weight_bytes)
                models.append(
                    ModelDemand(
                        m.name,
                        max(own + adapter_bytes(m, snap.pool.page_bytes), 1),
                        slo,
                        self.rates.rate(m.name, now),
                        last_used=m.last_used,
                    )
                )
                current[m.name] = (snap.device,) if m.residency.on_device else None
                where[m.name] = (snap.device, m)
        placement = plan(models, devices, current, self.threshold, idle_kv_fraction=0.0)
        moving = []
        for name, src, dst in placement.moves(current):
            device, m = where[name]
            w = workers[device]
            if dst is None and not m.num_requests and not m.pinned:
                w.send(PlanEvict(name))
                self.moves_sent += 1
            elif src is None and dst is not None:
                demand = next(x.demand for x in models if x.name == name)
                if demand > 0 and dst[0] != device:
                    moving.append((name, dst[0]))
                elif demand > 0:
                    w.send(Prefetch(name))
                    self.moves_sent += 1
        for name, device in moving:  # each waits for its model to be built on the other device
            if self.engine.migrate(name, device):
                self.moves_sent += 1
                self.migrations += 1
        self.last = PlanView(
            now,
            placement,
            {x.name: x.rate for x in models},
            {x.name: x.demand for x in models},
            {x.name: x.weight_bytes for x in models},
        )
        return self.last
