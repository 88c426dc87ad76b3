"""The serving policies a device can run, chosen by name (`--policy`): Prism's and the two
baselines it is measured against, in the same server so that a bench compares policies and
nothing else.

- `prism`: the arbitrator (Moore-Hodgson admission, slack-aware model choice, chunked prefill),
  the balloon (KV pages move between models; idle owners give first; a model blocked on KV may
  evict idle models, or preempt other models' requests for new work; one starved model takes at
  a time, so two never take from each other), admission that reserves
  KV for the output it admits (so a burst is not preempted and recomputed), and planner-driven
  residency.
- `static`: the static-partition baseline (MuxServe style): every model resident for good, the
  KV room split into fixed equal quotas, FCFS per model, models stepped round-robin.
- `swap`: the time-sharing baseline (QLM / ServerlessLLM / llama-swap style): one model on the
  device at a time, with the whole pool for its KV; when it has no work left it is evicted at
  once and the model whose request has waited longest is swapped in. FCFS.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    arbitrate: bool  # the arbitrator picks each step (else every model with work, round-robin)
    balloon: bool  # KV pages move between models (else fixed equal quotas, never reclaimed)
    evict_for_kv: bool  # a model that waits for KV pages may evict idle models
    evict_idle: bool  # an idle model leaves at once (time sharing)
    plan: bool  # the planner decides residency and placement ahead of requests
    all_resident: bool  # every model stays resident (static)
    max_resident: int | None = None  # models on the device at once (swap: 1, time sharing)
    # admission reserves KV for this much of each request's output (0: greedy, vLLM style)
    reserve_output_tokens: int = 0


POLICIES = {
    "prism": Policy("prism", True, True, True, False, True, False, reserve_output_tokens=1024),
    "static": Policy("static", False, False, False, False, False, True),
    "swap": Policy("swap", False, True, False, True, False, False, max_resident=1),
}


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
