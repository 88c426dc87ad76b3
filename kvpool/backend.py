"""Physical memory backends: the only code that talks to a driver.

A backend creates physical handles of a fixed size, reserves virtual address ranges, maps handles
into them and exposes a zero-copy torch view over a whole range. Both backends (host memory here,
CUDA VMM later) satisfy the same contract, so everything above them is tested on CPU.

Contract:
- `granularity` divides every handle size, reservation size and mapping offset.
- A view stays valid (same address) for the life of its reservation; touching an unmapped part of
  it is undefined (a segfault on the host, a fault on the GPU). Callers keep that invariant.
- A handle may be mapped at several places at once (the shared null page uses that).
- `map_many` / an `unmap` spanning several mappings are one batch: backends whose driver charges
  per call (CUDA: per handle, DESIGN.md §3) may use fewer calls; the result is the same.
- Methods are not thread-safe; the page pool serializes calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PhysicalHandle:
    """One physical allocation of `size` bytes (identity semantics)."""

    size: int
    raw: object  # backend-specific (fd, CUmemGenericAllocationHandle)


@dataclass(eq=False)
class Reservation:
    """A reserved virtual address range."""

    addr: int
    size: int


class MemoryBackend(ABC):
    device: torch.device

    @property
    @abstractmethod
    def granularity(self) -> int: ...

    @abstractmethod
    def create(self, size: int) -> PhysicalHandle: ...

    @abstractmethod
    def release(self, handle: PhysicalHandle) -> None: ...

    @abstractmethod
    def reserve(self, size: int) -> Reservation: ...

    @abstractmethod
    def free(self, res: Reservation) -> None: ...

    @abstractmethod
    def map(self, res: Reservation, offset: int, handle: PhysicalHandle) -> None: ...

    def map_many(self, res: Reservation, mappings: Sequence[tuple[int, PhysicalHandle]]) -> None:
        """map() each (offset, handle) pair; all or none are mapped when it returns."""
        done: list[tuple[int, PhysicalHandle]] = []
        try:
            for offset, handle in mappings:
                self.map(res, offset, handle)
                done.append((offset, handle))
        except BaseException:
            for offset, handle in done:
                self.unmap(res, offset, handle.size)
            raise

    @abstractmethod
    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        """Unmap [offset, offset + size); the range may span several mappings."""

    @abstractmethod
    def view(self, res: Reservation) -> torch.Tensor:
        """A uint8 tensor over the whole reservation, on `device`."""

    def round_up(self, size: int) -> int:
        g = self.granularity
        return -(-size // g) * g
