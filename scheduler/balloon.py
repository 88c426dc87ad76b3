"""The balloon policy: which models give pages back when another needs them.

Today it is one rule, the order in which the page pool reclaims other owners' cached (mapped but
unused) pages: least recently grown first, so the model that burst last keeps its reserve. The
pool only executes that order (kvpool holds no policy). Pure: plain data in, an order out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ReclaimCandidate(Protocol):
    name: str
    reclaimable: int  # pages it could give back now
    last_grow: int  # pool sequence number of its last grant (0 = never)


def reclaim_order(candidates: Sequence[ReclaimCandidate], requester: str) -> list[str]:
    """Owners to reclaim from, first to last; the requester and owners with nothing to give are
    left out."""
    ranked = sorted(
        (c for c in candidates if c.name != requester and c.reclaimable > 0),
        key=lambda c: (c.last_grow, c.name),
    )
    return [c.name for c in ranked]
