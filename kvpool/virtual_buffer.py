"""A reserved virtual address range with physical pages mapped in and out at fixed offsets.

Addresses never change for the life of the buffer, so views (and CUDA graphs captured over them)
stay valid while residency changes underneath.
"""

from __future__ import annotations

import torch

from kvpool.backend import MemoryBackend, PhysicalHandle


class VirtualBuffer:
    def __init__(self, backend: MemoryBackend, size: int):
        self.backend = backend
        self.res = backend.reserve(size)
        self._mapped: dict[int, PhysicalHandle] = {}  # offset -> handle
        self._view = backend.view(self.res)

    @property
    def size(self) -> int:
        return self.res.size

    def map(self, offset: int, handle: PhysicalHandle) -> None:
        if offset in self._mapped:
            raise RuntimeError(f"offset {offset} is already mapped")
        self.backend.map(self.res, offset, handle)
        self._mapped[offset] = handle

    def map_many(self, mappings: list[tuple[int, PhysicalHandle]]) -> None:
        """Map several (offset, handle) pairs in one backend batch."""
        offsets = [o for o, _ in mappings]
        if len(set(offsets)) != len(offsets) or any(o in self._mapped for o in offsets):
            raise RuntimeError(f"some of offsets {offsets} are already mapped")
        self.backend.map_many(self.res, mappings)
        self._mapped.update(mappings)

    def unmap(self, offset: int) -> PhysicalHandle:
        handle = self._mapped.pop(offset)
        self.backend.unmap(self.res, offset, handle.size)
        return handle

    def unmap_many(self, offsets: list[int]) -> list[PhysicalHandle]:
        """Unmap several offsets, one backend call per run of adjacent mappings; returns their
        handles in the order of `offsets`."""
        handles = [self._mapped[o] for o in offsets]
        runs: list[list[int]] = []  # [start, size]
        for o in sorted(offsets):
            if runs and runs[-1][0] + runs[-1][1] == o:
                runs[-1][1] += self._mapped[o].size
            else:
                runs.append([o, self._mapped[o].size])
        for start, size in runs:
            self.backend.unmap(self.res, start, size)
        for o in offsets:
            del self._mapped[o]
        return handles

    def mapped_offsets(self) -> list[int]:
        return sorted(self._mapped)

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat tensor of `dtype` over the whole range (zero-copy)."""
        return self._view.view(dtype)

    def close(self) -> None:
        for offset in list(self._mapped):
            self.backend.unmap(self.res, offset, self._mapped.pop(offset).size)
        self.backend.free(self.res)
