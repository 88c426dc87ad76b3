"""The KVPR planner: which models are resident on which devices, and which are offloaded.

A model's TTFT demand is d_i = r_i / s_i (its request rate over its TTFT SLO): how many prefills a
second it must start, weighted by how soon each must finish. What lets a device meet that demand is
the KV room left beside the weights it holds, so the planner balances the KV pressure ratio

    KVPR(g) = sum of d_i over the models on g / (C_g - sum of their weights on g)

and places models so that the highest KVPR over the devices is low. A device with no room left
(denominator <= 0) has an infinite KVPR: nothing may be placed that way. A model of tensor-parallel
degree k occupies k distinct devices with w_i / k of its weights and d_i / k of its demand on each.

`plan` places the models with demand by a greedy, then the idle ones (zero rate) while they leave
enough KV room, and keeps the current placement unless the fresh one is clearly better, so that a
control loop that re-plans every few seconds does not move models back and forth. `RateTracker`
gives the per-model rates it needs from arrival events.

Pure decision code: plain data in, a placement out; the time is passed in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ZERO_RATE = 1e-6  # req/s; a tracked rate below this is exactly 0, so the model counts as idle

Spot = tuple[str, ...]  # the devices a placed model occupies, in device order
Move = tuple[str, Spot | None, Spot | None]  # (model, from, to); None = offloaded
Current = Mapping[str, str | Spot | None]  # a placement as the control loop holds it


@dataclass(frozen=True)
class ModelDemand:
    """One model as the planner sees it: its weights, its SLO and its recent request rate."""

    name: str
    weight_bytes: float  # all its weights (over all tensor-parallel ranks)
    ttft_slo_s: float
    rate: float  # requests/s, an EWMA (RateTracker)
    tp: int = 1  # tensor-parallel degree: the number of distinct devices it spans
    last_used: float = 0.0  # when it last served (seconds); orders the idle models

    def __post_init__(self):
        if not self.weight_bytes > 0:
            raise ValueError(f"{self.name}: weight_bytes must be positive")
        if not self.ttft_slo_s > 0:
            raise ValueError(f"{self.name}: ttft_slo_s must be positive")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ValueError(f"{self.name}: rate must be finite and non-negative")
        if self.tp < 1:
            raise ValueError(f"{self.name}: tp must be at least 1")

    @property
    def demand(self) -> float:
        """d_i = r_i / s_i: prefills a second weighted by the urgency of each."""
        return self.rate / self.ttft_slo_s

    @property
    def idle(self) -> bool:
        return self.demand == 0

    @property
    def share_bytes(self) -> float:
        """The weights it puts on each of its devices."""
        return self.weight_bytes / self.tp

    @property
    def share_demand(self) -> float:
        """The demand it puts on each of its devices."""
        return self.demand / self.tp


@dataclass(frozen=True)
class DeviceCapacity:
    """One device: the bytes its page pool can give to weights and KV together."""

    name: str
    capacity_bytes: float

    def __post_init__(self):
        if not self.capacity_bytes > 0:
            raise ValueError(f"{self.name}: capacity_bytes must be positive")


@dataclass(frozen=True)
class Placement:
    """Where each model is: `assignment` for the resident ones (by model name), `offloaded` for the
    rest (both in name order), and the KVPR this gives each device (in device order)."""

    assignment: dict[str, Spot]
    offloaded: tuple[str, ...]
    kvpr: dict[str, float]

    @property
    def max_kvpr(self) -> float:
        return max(self.kvpr.values(), default=0.0)

    def moves(self, previous: Placement | Current | None) -> list[Move]:
        """What the control loop must do to go from `previous` to this placement: one
        (model, from, to) per model whose devices change, in name order; None is offloaded. A model
        `previous` placed that this placement does not know any more moves to None."""
        before = _as_spots(previous)
        known = set(self.assignment) | set(self.offloaded)
        out: list[Move] = []
        for name in sorted(known | set(before)):
            src, dst = before.get(name), self.assignment.get(name)
            if src != dst:
                out.append((name, src, dst))
        return out


def kvpr(models_on_device: Iterable[ModelDemand], capacity_bytes: float) -> float:
    """The KVPR of a device of `capacity_bytes` holding these models (each with its per-device
    share: w_i / tp and d_i / tp); infinite when their weights leave no room."""
    models = list(models_on_device)
    demand = math.fsum(m.share_demand for m in models)
    room = capacity_bytes - math.fsum(m.share_bytes for m in models)
    return _ratio(demand, room)


def _ratio(demand: float, room: float) -> float:
    return demand / room if room > 0 else math.inf


def _priority(m: ModelDemand) -> tuple[float, str]:
    """Greedy order: the most demand per byte of weights first (ties by name)."""
    return -m.demand / m.weight_bytes, m.name


def _recency(m: ModelDemand) -> tuple[float, str]:
    """Idle order: the most recently used first (ties by name)."""
    return -m.last_used, m.name


class _Fleet:
    """The devices while one plan fills them: the per-device shares placed so far. Sums are
    `math.fsum`, exact whatever the order, so the same models on a device always give the same
    KVPR (a kept placement and a fresh one compare without rounding noise)."""

    def __init__(self, devices: Sequence[DeviceCapacity]):
        self.devices = devices
        self.capacity = [d.capacity_bytes for d in devices]
        self.demands: list[list[float]] = [[] for _ in devices]
        self.weights: list[list[float]] = [[] for _ in devices]
        self.spots: dict[str, tuple[int, ...]] = {}

    def room_after(self, g: int, weight: float) -> float:
        return self.capacity[g] - math.fsum([*self.weights[g], weight])

    def kvpr_after(self, g: int, demand: float, weight: float) -> float:
        return _ratio(math.fsum([*self.demands[g], demand]), self.room_after(g, weight))

    def fits(self, m: ModelDemand, spot: tuple[int, ...], min_room: Sequence[float]) -> bool:
        """Whether each device of `spot` keeps a positive room of at least min_room[g]."""
        for g in spot:
            room = self.room_after(g, m.share_bytes)
            if not (room > 0 and room >= min_room[g]):
                return False
        return True

    def best_spot(self, m: ModelDemand, min_room: Sequence[float]) -> tuple[int, ...] | None:
        """The spot (tp distinct devices, every combination in device order) that gives the lowest
        max KVPR over the devices it touches; ties: the lower sum of those KVPRs, then the
        earlier combination. None when it fits nowhere."""
        best: tuple[float, float, tuple[int, ...]] | None = None
        for spot in itertools.combinations(range(len(self.devices)), m.tp):
            if not self.fits(m, spot, min_room):
                continue
            after = [self.kvpr_after(g, m.share_demand, m.share_bytes) for g in spot]
            key = (max(after), math.fsum(after), spot)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def put(self, m: ModelDemand, spot: tuple[int, ...]) -> None:
        for g in spot:
            self.demands[g].append(m.share_demand)
            self.weights[g].append(m.share_bytes)
        self.spots[m.name] = spot

    def place(self, m: ModelDemand, min_room: Sequence[float]) -> bool:
        spot = self.best_spot(m, min_room)
        if spot is not None:
            self.put(m, spot)
        return spot is not None

    def table(self) -> list[float]:
        return [
            _ratio(math.fsum(self.demands[g]), self.capacity[g] - math.fsum(self.weights[g]))
            for g in range(len(self.devices))
        ]

    def max_kvpr(self) -> float:
        return max(self.table(), default=0.0)

    def unserved_demand(self, models: Iterable[ModelDemand]) -> float:
        return math.fsum(m.demand for m in models if m.name not in self.spots)

    def placement(self, models: Iterable[ModelDemand]) -> Placement:
        names = sorted(m.name for m in models)
        return Placement(
            assignment={
                n: tuple(self.devices[g].name for g in self.spots[n])
                for n in names
                if n in self.spots
            },
            offloaded=tuple(n for n in names if n not in self.spots),
            kvpr={d.name: k for d, k in zip(self.devices, self.table())},
        )


def _greedy(
    order: Sequence[ModelDemand], devices: Sequence[DeviceCapacity], min_room: Sequence[float]
) -> _Fleet:
    fleet = _Fleet(devices)
    for m in order:
        fleet.place(m, min_room)
    return fleet


def _place_active(
    active: Sequence[ModelDemand],
    devices: Sequence[DeviceCapacity],
    min_room: Sequence[float],
    promote_unplaced: bool,
) -> _Fleet:
    """The greedy over the models with demand (given in priority order). With `promote_unplaced`,
    models a pass could not place go first in the next pass (in priority order among themselves),
    until a pass places them all or leaves no model unplaced that was not already promoted; the
    pass leaving the least demand unplaced wins (ties: fewer models unplaced, the lower max
    KVPR, then the earlier)."""
    promoted: list[ModelDemand] = []
    best: tuple[float, int, float, _Fleet] | None = None
    while True:
        first = {m.name for m in promoted}
        order = promoted + [m for m in active if m.name not in first]
        fleet = _greedy(order, devices, min_room)
        unplaced = [m for m in active if m.name not in fleet.spots]
        key = (fleet.unserved_demand(active), len(unplaced), fleet.max_kvpr())
        if best is None or key < best[:3]:
            best = (*key, fleet)
        new = [m for m in unplaced if m.name not in first]
        if not (promote_unplaced and new):
            return best[3]
        promoted = sorted(promoted + new, key=_priority)


def _as_spots(current: Placement | Current | None) -> dict[str, Spot]:
    if current is None:
        return {}
    items = current.assignment if isinstance(current, Placement) else current
    out: dict[str, Spot] = {}
    for name, where in items.items():
        if where is not None:
            out[name] = (where,) if isinstance(where, str) else tuple(where)
    return out


def _current_spots(
    current: Placement | Current | None,
    models: Sequence[ModelDemand],
    devices: Sequence[DeviceCapacity],
) -> dict[str, tuple[int, ...]]:
    """The current spots as device indices, keeping only those still valid: known model, known
    devices, as many distinct devices as its tp."""
    index = {d.name: g for g, d in enumerate(devices)}
    tp = {m.name: m.tp for m in models}
    out: dict[str, tuple[int, ...]] = {}
    for name, spot in _as_spots(current).items():
        if name in tp and len(set(spot)) == len(spot) == tp[name] and set(spot) <= set(index):
            out[name] = tuple(sorted(index[d] for d in spot))
    return out


def _check(
    models: Sequence[ModelDemand],
    devices: Sequence[DeviceCapacity],
    threshold: float,
    min_kv_bytes: float,
    idle_kv_fraction: float,
) -> None:
    if len({m.name for m in models}) != len(models):
        raise ValueError("model names must be unique")
    if len({d.name for d in devices}) != len(devices):
        raise ValueError("device names must be unique")
    if not 0 <= threshold < 1:
        raise ValueError("threshold must be in [0, 1)")
    if not min_kv_bytes >= 0:
        raise ValueError("min_kv_bytes must be non-negative")
    if not 0 <= idle_kv_fraction <= 1:
        raise ValueError("idle_kv_fraction must be in [0, 1]")


def plan(
    models: Sequence[ModelDemand],
    devices: Sequence[DeviceCapacity],
    current: Placement | Current | None = None,
    threshold: float = 0.2,
    *,
    min_kv_bytes: float = 0.0,
    idle_kv_fraction: float = 0.5,
    promote_unplaced: bool = True,
) -> Placement:
    """Which models are resident where, and which are offloaded.

    Fresh placement. The models with demand go first, in descending d_i / w_i (ties by name), each
    onto the spot (tp distinct devices) that gives the lowest max KVPR over the devices it touches
    (ties: the lower sum of their KVPRs, then device order), keeping at least `min_kv_bytes` of KV
    room on every device; a model that fits nowhere is offloaded. With `promote_unplaced` (the
    default) such a model gets another pass in which it goes first (see `_place_active`), so that a
    large model of low demand per byte is not crowded out by the small ones; the pass leaving the
    least demand unplaced wins. Then the idle models (zero rate), most recently used first (ties by
    name), go by the same rule, but only where every device they touch keeps at least
    `idle_kv_fraction` of its capacity as KV room; the others are offloaded. idle_kv_fraction=0
    keeps every idle model that fits.

    Re-plan (`current` given: the previous Placement, or model -> device name(s) or None). The kept
    placement is `current` under the new demand: each model with demand stays where it is (in the
    greedy order) while its devices keep `min_kv_bytes`; those without a valid spot (new, newly
    demanded, on a device that is gone, or no longer fitting) are then placed by the greedy onto
    what is left; the idle models stay where they are while the idle rule holds there, and are
    otherwise placed as in a fresh placement. The fresh placement is adopted only when the demand
    it leaves unplaced is below the kept one's times (1 - threshold), or no more than it and its
    max KVPR is below the kept one's times (1 - threshold); otherwise the kept placement is
    returned (so a model with more demand takes the place of one with less, but near-ties do not
    swap). Under stationary demand the fresh
    placement equals the kept one, so feeding each result back as `current` never moves a model.
    """
    _check(models, devices, threshold, min_kv_bytes, idle_kv_fraction)
    active = sorted((m for m in models if not m.idle), key=_priority)
    idle = sorted((m for m in models if m.idle), key=_recency)
    active_room = [min_kv_bytes] * len(devices)
    idle_room = [max(min_kv_bytes, idle_kv_fraction * d.capacity_bytes) for d in devices]

    fresh = _place_active(active, devices, active_room, promote_unplaced)
    for m in idle:
        fresh.place(m, idle_room)
    if current is None:
        return fresh.placement(models)

    spots = _current_spots(current, models, devices)
    kept = _Fleet(devices)
    for m in active:
        spot = spots.get(m.name)
        if spot is not None and kept.fits(m, spot, active_room):
            kept.put(m, spot)
    for m in active:
        if m.name not in kept.spots:
            kept.place(m, active_room)
    for m in idle:
        spot = spots.get(m.name)
        if spot is not None and kept.fits(m, spot, idle_room):
            kept.put(m, spot)
        else:
            kept.place(m, idle_room)

    fresh_left, kept_left = fresh.unserved_demand(active), kept.unserved_demand(active)
    if fresh_left < kept_left * (1 - threshold) or (
        fresh_left <= kept_left and fresh.max_kvpr() < kept.max_kvpr() * (1 - threshold)
    ):
        return fresh.placement(models)
    return kept.placement(models)


def exhaustive_best(
    models: Sequence[ModelDemand],
    devices: Sequence[DeviceCapacity],
    *,
    min_kv_bytes: float = 0.0,
) -> Placement | None:
    """The placement of every model (idle ones included) with the lowest max KVPR, by enumerating
    every assignment (ties: the lower sum of KVPRs, then the first enumerated); None when no
    assignment fits them all. Exponential: the reference the greedy is checked against on small
    fleets."""
    _check(models, devices, 0.0, min_kv_bytes, 0.0)
    ordered = sorted(models, key=lambda m: m.name)
    options = [list(itertools.combinations(range(len(devices)), m.tp)) for m in ordered]
    min_room = [min_kv_bytes] * len(devices)
    best: tuple[float, float, _Fleet] | None = None
    for choice in itertools.product(*options):
        fleet = _Fleet(devices)
        for m, spot in zip(ordered, choice):
            if not fleet.fits(m, spot, min_room):
                break
            fleet.put(m, spot)
        else:
            table = fleet.table()
            key = (max(table, default=0.0), math.fsum(table))
            if best is None or key < best[:2]:
                best = (*key, fleet)
    return None if best is None else best[2].placement(models)


class RateTracker:
    """Per-model request rate from arrival events: an exponentially decayed count of arrivals,
    with a half-life of `half_life_s`, scaled to requests/s (a steady stream of r req/s reads r).
    A model unheard of for long decays to 0, exactly 0 below ZERO_RATE, so the planner sees it
    idle. Pure: the time is passed in; an arrival older than the last one counts as of the last."""

    def __init__(self, half_life_s: float = 30.0):
        if not half_life_s > 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s = half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # model -> (decayed count, as of when)

    def _decayed(self, model: str, now: float) -> tuple[float, float]:
        count, since = self._counts.get(model, (0.0, now))
        return count * 0.5 ** (max(now - since, 0.0) / self.half_life_s), max(now, since)

    def observe(self, model: str, now: float, n: int = 1) -> None:
        """`n` requests for `model` arrived at `now`."""
        count, since = self._decayed(model, now)
        self._counts[model] = (count + n, since)

    def rate(self, model: str, now: float) -> float:
        """Requests/s for `model` as of `now`; 0 for a model never observed."""
        count, _ = self._decayed(model, now)
        r = count * math.log(2) / self.half_life_s
        return r if r >= ZERO_RATE else 0.0

    def rates(self, now: float) -> dict[str, float]:
        """Every observed model's rate, in name order."""
        return {m: self.rate(m, now) for m in sorted(self._counts)}
