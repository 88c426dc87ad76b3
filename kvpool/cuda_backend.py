"""CUDA VMM backend: the page pool's physical pages as driver handles (cuda-python driver API).

handle = cuMemCreate (pinned device memory, a multiple of the device's granularity); reservation =
cuMemAddressReserve; map = cuMemMap + cuMemSetAccess (read/write for the device); unmap =
cuMemUnmap (one call may span adjacent mappings); view = a uint8 tensor over the whole range
through `__cuda_array_interface__` (zero-copy, the address never changes).

What the driver charges (DESIGN.md §3, measured on the H200): ~10 us per cuMemCreate, ~1.3 us per
cuMemMap, ~21-24 us per cuMemSetAccess and ~15 us per cuMemUnmap, per handle whatever its size; the
driver serializes threads. So the pool creates few, large handles ahead of need and keeps them.

Every call runs with the device's primary context current: the context torch's runtime uses, so
views and kernels see the same address space. Any thread may call in (a device's engine thread
maps pages in another device's pool for a model split over both): for the call, this device's
context is made current on the calling thread, and the thread's own is current again after. The
runtime's current device is the thread's current context, so a context left current would move
the thread's torch device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation


def _driver_module():
    try:
        from cuda.bindings import driver  # cuda-bindings >= 12.6
    except ImportError:  # older cuda-python
        from cuda import cuda as driver
    return driver


class CudaDriverError(RuntimeError):
    """A driver call failed; `code` is the CUresult."""

    def __init__(self, call: str, code, message: str):
        super().__init__(f"{call} failed: {getattr(code, 'name', code)}: {message}")
        self.code = code


class _DeviceRange:
    """[addr, addr + size) as a 1-D uint8 device array (CUDA array interface v3)."""

    def __init__(self, addr: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


class CudaBackend(MemoryBackend):
    def __init__(self, device: torch.device | str | int = "cuda"):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaBackend needs a CUDA device, got {device}")
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(self.device):  # torch's runtime holds the primary context
            torch.cuda.current_stream(self.device)
        self.cu = cu = _driver_module()
        self._call(cu.cuInit, 0)
        self._dev = self._call(cu.cuDeviceGet, index)
        self._ctx = self._call(cu.cuDevicePrimaryCtxRetain, self._dev)
        self._ctx_id = int(self._ctx)

        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        with self._current():
            self._granularity = int(self._call(cu.cuMemGetAllocationGranularity, prop, flag))

    # ---- driver plumbing ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _current(self):
        """This device's primary context current on the calling thread for the block, and the
        thread's own again after (a thread already in it pays one query)."""
        prev = self._call(self.cu.cuCtxGetCurrent)
        if int(prev) == self._ctx_id:
            yield
            return
        self._call(self.cu.cuCtxSetCurrent, self._ctx)
        try:
            yield
        finally:
            self.cu.cuCtxSetCurrent(prev)

    def _error_string(self, err) -> str:
        res = self.cu.cuGetErrorString(err)
        msg = res[1] if len(res) > 1 else None
        return msg.decode() if isinstance(msg, bytes) else str(msg)

    def _call(self, fn, *args):
        """fn(*args) -> its value(s); raises CudaDriverError unless CUDA_SUCCESS. The caller has
        made the context current where fn needs one (_current)."""
        res = fn(*args)
        err = res[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise CudaDriverError(getattr(fn, "__name__", str(fn)), err, self._error_string(err))
        if len(res) == 1:
            return None
        return res[1] if len(res) == 2 else res[1:]

    # ---- the contract ---------------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._granularity

    def create(self, size: int) -> PhysicalHandle:
        assert size % self.granularity == 0, size
        with self._current():
            raw = self._call(self.cu.cuMemCreate, size, self._prop, 0)
        return PhysicalHandle(size=size, raw=raw)

    def release(self, handle: PhysicalHandle) -> None:
        with self._current():
            self._call(self.cu.cuMemRelease, handle.raw)
        handle.raw = None

    def reserve(self, size: int) -> Reservation:
        size = self.round_up(size)
        with self._current():
            ptr = self._call(self.cu.cuMemAddressReserve, size, 0, 0, 0)
        return Reservation(addr=int(ptr), size=size)

    def free(self, res: Reservation) -> None:
        with self._current():
            self._call(self.cu.cuMemAddressFree, res.addr, res.size)

    def map(self, res: Reservation, offset: int, handle: PhysicalHandle) -> None:
        assert offset % self.granularity == 0 and offset + handle.size <= res.size
        addr = res.addr + offset
        with self._current():
            self._call(self.cu.cuMemMap, addr, handle.size, 0, handle.raw, 0)
            try:
                self._call(self.cu.cuMemSetAccess, addr, handle.size, self._access, 1)
            except CudaDriverError:
                self._call(self.cu.cuMemUnmap, addr, handle.size)
                raise

    def map_many(self, res: Reservation, mappings: Sequence[tuple[int, PhysicalHandle]]) -> None:
        """cuMemMap each handle, then one cuMemSetAccess per run of adjacent mappings."""
        mapped: list[tuple[int, int]] = []  # (offset, size)
        with self._current():
            try:
                for offset, handle in sorted(mappings, key=lambda m: m[0]):
                    assert offset % self.granularity == 0 and offset + handle.size <= res.size
                    self._call(self.cu.cuMemMap, res.addr + offset, handle.size, 0, handle.raw, 0)
                    mapped.append((offset, handle.size))
                for start, size in _runs(mapped):
                    self._call(self.cu.cuMemSetAccess, res.addr + start, size, self._access, 1)
            except BaseException:
                for offset, size in mapped:
                    self.cu.cuMemUnmap(res.addr + offset, size)  # best effort: the first error
                raise

    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        assert offset % self.granularity == 0 and offset + size <= res.size
        with self._current():
            self._call(self.cu.cuMemUnmap, res.addr + offset, size)

    def view(self, res: Reservation) -> torch.Tensor:
        # NOTE: torch asks the driver which device a pointer lives on (cudaPointerGetAttributes),
        # which fails for an address nothing is mapped at; so when offset 0 is unmapped, a probe
        # page backs it while the tensor is made. The tensor keeps the address, not the mapping.
        try:
            return self._as_tensor(res)
        except RuntimeError:
            probe = self.create(self.granularity)
            try:
                self.map(res, 0, probe)
                try:
                    return self._as_tensor(res)
                finally:
                    self.unmap(res, 0, probe.size)
            finally:
                self.release(probe)

    def _as_tensor(self, res: Reservation) -> torch.Tensor:
        with self._current():
            t = torch.as_tensor(_DeviceRange(res.addr, res.size), device=self.device)
        assert t.data_ptr() == res.addr and t.device == self.device
        return t


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (offset, size) spans -> maximal runs of adjacent spans."""
    runs: list[list[int]] = []
    for offset, size in spans:
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += size
        else:
            runs.append([offset, size])
    return [(o, s) for o, s in runs]
