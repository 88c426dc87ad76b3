"""The balloon policy: which models give pages back when another needs them.

The order in which the page pool reclaims other owners' cached (mapped but unused) pages: owners
of idle models (no request queued or running) first, then least recently grown first, so the
model that burst last keeps its reserve. The pool only executes that order (kvpool holds no
policy). Past the reserves, the device worker evicts idle models for a model blocked on KV (the
last resort before waiting: a running request is never failed for memory). Pure: plain data in,
an order out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ReclaimCandidate(Protocol):
    name: str
    reclaimable: int  # pages it could give back now
    last_grow: int  # pool sequence number of its last grant (0 = never)


def reclaim_order(
    candidates: Sequence[ReclaimCandidate], requester: str, busy: frozenset[str] = frozenset()
) -> list[str]:
    """Owners to reclaim from, first to last; the requester and owners with nothing to give are
    left out. busy: owners whose models have requests (they give after the idle ones)."""
    ranked = sorted(
        (c for c in candidates if c.name != requester and c.reclaimable > 0),
        key=lambda c: (c.name in busy, c.last_grow, c.name),
    )
    return [c.name for c in ranked]
