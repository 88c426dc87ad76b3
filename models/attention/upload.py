"""A step's small host tensors onto the device: from pinned memory, in one copy, never waiting.

A copy from pageable memory makes the driver stage it first; the profiler showed each such copy
holding the host for about 0.4 ms before a long prefill's first kernel, the device idle
meanwhile. Pinned buffers come from torch's caching host allocator, which hands a buffer out
again only once the copy that read it has run, so nothing here waits for the device.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

_ALIGN = 16  # bytes: every tensor's slice of the packed buffer starts aligned for any dtype
_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_ints(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A list of ints as a host tensor of int64 or int32, through a C array: about 3.5x faster
    than torch.tensor(list) (scripts/bench_host_prep.py: an 8k prompt's ids and positions in
    0.25 vs 0.89 ms on a 2-core EPYC)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def _packed(tensors: Sequence[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes in one host buffer (pinned when `pin`), each from a 16-byte aligned
    offset; the buffer and the offsets."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    packed = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            packed[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return packed, offsets


def _views(buf: torch.Tensor, like: Sequence[torch.Tensor], offsets: list[int]) -> list:
    """Each of `like` as a view of buf's bytes from its offset."""
    return [
        buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, off in zip(like, offsets)
    ]


def upload(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors -> the same values on `device`, in order. On a GPU they travel packed in one
    pinned buffer and one asynchronous copy, each result a view of that copy; elsewhere each is
    moved as it is."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    packed, offsets = _packed(tensors, pin=True)
    return _views(packed.to(device, non_blocking=True), tensors, offsets)


def pinned(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors that a library will copy to `device` itself (FlashInfer's plan() copies its
    index arrays): on a GPU, the same values as views of one pinned buffer, so that each such
    copy is asynchronous rather than staged from pageable memory with the host held; elsewhere
    the tensors as they are. The caching host allocator keeps the buffer until the copies that
    read it have run."""
    if device.type != "cuda":
        return list(tensors)
    packed, offsets = _packed(tensors, pin=True)
    return _views(packed, tensors, offsets)


def tensor_on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (nested for a matrix) on the device without waiting for the device to drain
    (a tensor built with device= is a blocking copy, which waits for every step queued before
    it): through pinned memory on a GPU (see upload)."""
    return upload([torch.tensor(values, dtype=dtype)], device)[0]
