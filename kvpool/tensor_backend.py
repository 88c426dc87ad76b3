"""A backend without virtual memory: each reservation is one plain torch allocation, fully backed
from the start; map/unmap only check bounds. It exists as the reference that measures what VMM
costs (same layout, same code path, KV in an ordinary tensor), not for serving: it holds a whole
reservation's memory whether pages are mapped or not, and handles share nothing (the null page of
each reservation is its own memory)."""

from __future__ import annotations

import torch

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation


class TensorBackend(MemoryBackend):
    def __init__(self, device: torch.device | str, granularity: int = 2 << 20):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._granularity = granularity
        self._buffers: dict[int, torch.Tensor] = {}  # reservation address -> its tensor

    @property
    def granularity(self) -> int:
        return self._granularity

    def create(self, size: int) -> PhysicalHandle:
        assert size % self.granularity == 0, size
        return PhysicalHandle(size=size, raw=None)

    def release(self, handle: PhysicalHandle) -> None:
        pass

    def reserve(self, size: int) -> Reservation:
        t = torch.empty(self.round_up(size), dtype=torch.uint8, device=self.device)
        self._buffers[t.data_ptr()] = t
        return Reservation(addr=t.data_ptr(), size=t.numel())

    def free(self, res: Reservation) -> None:
        del self._buffers[res.addr]

    def map(self, res: Reservation, offset: int, handle: PhysicalHandle) -> None:
        assert offset % self.granularity == 0 and offset + handle.size <= res.size

    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        assert offset % self.granularity == 0 and offset + size <= res.size

    def view(self, res: Reservation) -> torch.Tensor:
        return self._buffers[res.addr]
