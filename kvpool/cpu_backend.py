"""Host-memory backend with real virtual-memory semantics (Linux).

Physical handle = a memfd of the handle size; reservation = an mmap(PROT_NONE) range; map =
mmap(MAP_FIXED | MAP_SHARED) of the memfd at an offset; unmap = put PROT_NONE anonymous memory back.
Data in a handle survives unmap and a later map elsewhere, exactly like cuMemMap.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int = -1) -> int:
    out = _libc.mmap(addr, size, prot, flags, fd, 0)
    if out in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return out


class CpuBackend(MemoryBackend):
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._granularity = mmap.PAGESIZE

    @property
    def granularity(self) -> int:
        return self._granularity

    def create(self, size: int) -> PhysicalHandle:
        assert size % self.granularity == 0, size
        fd = os.memfd_create("prism-page", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return PhysicalHandle(size=size, raw=fd)

    def release(self, handle: PhysicalHandle) -> None:
        os.close(handle.raw)
        handle.raw = None

    def reserve(self, size: int) -> Reservation:
        size = self.round_up(size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        return Reservation(addr=_mmap(None, size, _PROT_NONE, flags), size=size)

    def free(self, res: Reservation) -> None:
        _libc.munmap(res.addr, res.size)

    def map(self, res: Reservation, offset: int, handle: PhysicalHandle) -> None:
        assert offset % self.granularity == 0 and offset + handle.size <= res.size
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        _mmap(res.addr + offset, handle.size, prot, mmap.MAP_SHARED | _MAP_FIXED, handle.raw)

    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        assert offset % self.granularity == 0 and offset + size <= res.size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        _mmap(res.addr + offset, size, _PROT_NONE, flags)

    def view(self, res: Reservation) -> torch.Tensor:
        buf = (ctypes.c_uint8 * res.size).from_address(res.addr)
        return torch.frombuffer(buf, dtype=torch.uint8)
