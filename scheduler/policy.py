"""The serving policies a device can run, chosen by name (`--policy`): Prism's and the two
baselines it is measured against, in the same server so that a bench compares policies and
nothing else. Each is a small strategy behind one protocol; the device worker asks it, never
tests what it is.

- `prism`: the arbitrator (Moore-Hodgson admission, slack-aware model choice, chunked prefill),
  the balloon (KV pages move between models; idle owners give first; a model blocked on KV may
  evict idle models, or preempt other models' requests for new work; one starved model takes at
  a time, so two never take from each other), admission that reserves KV for the output it
  admits (so a burst is not preempted and recomputed), and planner-driven residency.
- `static`: the static-partition baseline (MuxServe style): every model resident for good, the
  KV room split into fixed equal quotas, FCFS per model, models stepped round-robin.
- `swap`: the time-sharing baseline (QLM / ServerlessLLM / llama-swap style): one model on the
  device at a time, with the whole pool for its KV; when it has no work left it is evicted at
  once and the model whose request has waited longest is swapped in. FCFS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler import balloon
from scheduler.arbitrator import ModelWork, Pick, arbitrate
from scheduler.balloon import LastResort, ModelState, ReclaimCandidate

States = Callable[[], Sequence[ModelState]]  # builds the device's models' states when called


class Policy(Protocol):
    name: str
    # admission reserves KV for this much of each request's output (0: greedy, vLLM style)
    reserve_output_tokens: int
    max_resident: int | None  # models on the device at once (None: no cap)
    all_resident: bool  # every model stays resident, its KV a fixed quota (the engine pins)
    plan: bool  # the planner decides residency and placement ahead of requests
    keep_alive_s: float | None  # every model's keep-alive (None: each model's own)

    def pick(
        self, work: Callable[[], list[ModelWork]], now: float, overhead_s: float
    ) -> Pick | None:
        """The model to step and whom it admits; None: every serving model steps (round-robin).
        work: builds each serving model's work, called only by a policy that arbitrates."""
        ...

    def reclaims(self) -> bool:
        """Whether KV reserves move between models (else fixed quotas, never reclaimed)."""
        ...

    def reclaim_order(
        self, candidates: Sequence[ReclaimCandidate], requester: str, busy: frozenset[str]
    ) -> list[str]:
        """Owners to reclaim reserves from for `requester`, first to last."""
        ...

    def turn(self, states: States) -> frozenset[str] | None:
        """The offloaded models that may activate now; None: any that has work."""
        ...

    def next_taker(self, held: ModelState | None, starved: Sequence[ModelState]) -> str | None:
        """The starved model that may take memory from others (None: no one)."""
        ...

    def last_resort(
        self, m: ModelState, starved: frozenset[str], taker: str | None, now: float
    ) -> LastResort | None:
        """What m, short of pages the pool has not got, may take (None: it waits)."""
        ...


class _Default:
    """What a policy does unless it says otherwise (the baselines' shared part): every serving
    model steps round-robin, reserves move in the balloon's order, no cap on resident models,
    and nothing is taken from another model for KV."""

    reserve_output_tokens = 0
    max_resident: int | None = None
    all_resident = False
    plan = False
    keep_alive_s: float | None = None

    def pick(self, work, now: float, overhead_s: float) -> Pick | None:
        return None

    def reclaims(self) -> bool:
        return True

    def reclaim_order(self, candidates, requester: str, busy: frozenset[str]) -> list[str]:
        return balloon.reclaim_order(candidates, requester, busy)

    def turn(self, states: States) -> frozenset[str] | None:
        return None

    def next_taker(self, held, starved) -> str | None:
        return None

    def last_resort(self, m, starved, taker, now) -> LastResort | None:
        return None


class PrismPolicy(_Default):
    name = "prism"
    reserve_output_tokens = 1024
    plan = True

    def pick(self, work, now: float, overhead_s: float) -> Pick | None:
        return arbitrate(work(), now, overhead_s)

    def next_taker(self, held, starved) -> str | None:
        return balloon.next_taker(held, starved)

    def last_resort(self, m, starved, taker, now) -> LastResort | None:
        return balloon.last_resort(m, starved, taker, now)


class StaticPolicy(_Default):
    name = "static"
    all_resident = True

    def reclaims(self) -> bool:
        return False


class SwapPolicy(_Default):
    name = "swap"
    max_resident = 1
    keep_alive_s = 0.0  # an idle model leaves at once

    def turn(self, states: States) -> frozenset[str] | None:
        return balloon.swap_turn(self.max_resident, states())


POLICIES: dict[str, Policy] = {p.name: p for p in (PrismPolicy(), StaticPolicy(), SwapPolicy())}


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None


def static_quota(capacity_pages: int, weight_pages: list[int]) -> int:
    """Each model's fixed KV pages under `static`: what the weights leave, split equally."""
    if not weight_pages:
        return 0
    return max(0, capacity_pages - sum(weight_pages)) // len(weight_pages)
