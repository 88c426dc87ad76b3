"""The host copy of a model's weights: the source of truth while the model is offloaded. It has
the weight buffer's exact layout, so activation is one host-to-device copy in large chunks and
nothing else.

On CUDA the host memory is allocated as a plain tensor and then page-locked with cudaHostRegister
(measured on the H200: 16 GiB in 1.8 s, against 9.0 s through `torch.empty(pin_memory=True)`),
and copies run in chunks on a dedicated copy stream (16 GiB in 318 ms, 54 GB/s, against 345 ms for
one `copy_`), ending with an event the compute stream waits on. On the host it is a memcpy.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 << 20  # 64 chunks for 16 GiB


class HostCopy:
    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.device = device
        self.data = torch.empty(max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        self.pinned = False
        self._stream = None
        if device.type == "cuda" and nbytes:
            self.data.fill_(0)  # touch every page before pinning (registering is faster then)
            err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
            self.pinned = True
            self._stream = torch.cuda.Stream(device)

    def save(self, src: torch.Tensor) -> None:
        """Copy a device buffer's bytes (uint8, this copy's size) into the host copy."""
        self.data.copy_(src)

    def load(self, dst: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Copy the host copy into `dst` (uint8 on the device, mapped); returns when the bytes are
        usable by work later queued on the current stream."""
        if self._stream is None:
            dst.copy_(self.data)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the pages were just mapped: nothing may be pending
        with torch.cuda.stream(self._stream):
            for start in range(0, self.nbytes, chunk_bytes):
                end = min(start + chunk_bytes, self.nbytes)
                dst[start:end].copy_(self.data[start:end], non_blocking=True)
        current.wait_stream(self._stream)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
