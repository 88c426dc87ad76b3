"""The balloon policy's reclaim order, over plain data."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.balloon import reclaim_order


@dataclass(frozen=True)
class Owner:
    name: str
    reclaimable: int
    last_grow: int


def test_least_recently_grown_gives_first_and_the_requester_never():
    owners = [Owner("a", 3, 7), Owner("b", 2, 2), Owner("c", 0, 1), Owner("d", 1, 9)]
    assert reclaim_order(owners, "d") == ["b", "a"]  # c has nothing to give; d is asking
    assert reclaim_order(owners, "x") == ["b", "a", "d"]
    assert reclaim_order([], "a") == []
