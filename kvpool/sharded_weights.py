"""The weights of a model split over several devices (tensor parallelism): a WeightBuffer per
shard, each in its device's pool, and a HostCopy per shard. Mapped and unmapped together, all or
none; an activation copies every shard at once, each over its own GPU's link and copy stream.

They have the interface of one WeightBuffer and one HostCopy, so a model's residency (evict,
activate) handles a split model as it does a whole one. The first shard's buffer is the model's
own device's (its `pages` are what that device accounts)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kvpool.host_copy import HostCopy, Transfer
from kvpool.mirrored_pages import map_all
from kvpool.weight_buffer import WeightBuffer


class ShardedWeights:
    def __init__(self, parts: Sequence[WeightBuffer]):
        self.parts = list(parts)
        self.pages = self.parts[0].pages
        self.num_pages = self.parts[0].num_pages

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def mapped(self) -> bool:
        return all(p.mapped for p in self.parts)

    def can_map(self) -> bool:
        return all(p.can_map() for p in self.parts)

    def map(self) -> bool:
        """Every shard mapped, or none (False)."""
        return self.can_map() and map_all(self.parts, WeightBuffer.map, WeightBuffer.unmap)

    def unmap(self) -> None:
        for p in self.parts:
            p.unmap()

    def bytes(self) -> list[torch.Tensor]:
        return [p.bytes() for p in self.parts]

    def check_integrity(self) -> None:
        for p in self.parts:
            p.check_integrity()
        assert len({p.mapped for p in self.parts}) == 1, "some shards' weights mapped, not all"

    def close(self) -> None:
        for p in self.parts:
            p.close()


class _Transfers(Transfer):
    """Several copies in flight (one per shard): done when all are."""

    def __init__(self, parts: list[Transfer]):
        super().__init__()
        self.parts = parts

    def done(self) -> bool:
        return all(t.done() for t in self.parts)

    def wait(self) -> None:
        """Every part landed or failed, then the first failure raised: the caller unmaps the
        pages on a failure, and none may still be written then."""
        _wait_all(self.parts)


def _wait_all(parts: Sequence[Transfer]) -> None:
    first: BaseException | None = None
    for t in parts:
        try:
            t.wait()
        except BaseException as e:  # noqa: BLE001 (the first is raised once all are done)
            first = first or e
    if first is not None:
        raise first


class ShardedHostCopy:
    def __init__(self, parts: Sequence[HostCopy]):
        self.parts = list(parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def save(self, srcs: list[torch.Tensor]) -> None:
        for p, s in zip(self.parts, srcs, strict=True):
            p.save(s)

    def load_async(self, dsts: list[torch.Tensor]) -> Transfer:
        """Every shard's copy started at once, each on its own device's copy stream. If one
        cannot start, those started are waited for before the error is raised."""
        started: list[Transfer] = []
        try:
            for p, d in zip(self.parts, dsts, strict=True):
                started.append(p.load_async(d))
        except BaseException:
            with contextlib.suppress(BaseException):  # the error that stopped the start wins
                _wait_all(started)
            raise
        return _Transfers(started)

    def close(self) -> None:
        for p in self.parts:
            p.close()
