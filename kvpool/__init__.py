"""kvpool: physical pages shared by the models of a device, virtual buffers, paged KV caches."""

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation
from kvpool.block_allocator import BlockAllocator
from kvpool.cpu_backend import CpuBackend
from kvpool.cuda_backend import CudaBackend, CudaDriverError
from kvpool.kv_cache import KVCache
from kvpool.kv_layout import KVLayout
from kvpool.page_pool import PagePool, PoolStats
from kvpool.tensor_backend import TensorBackend
from kvpool.virtual_buffer import VirtualBuffer

__all__ = [
    "BlockAllocator",
    "CpuBackend",
    "CudaBackend",
    "CudaDriverError",
    "KVCache",
    "KVLayout",
    "MemoryBackend",
    "PagePool",
    "PhysicalHandle",
    "PoolStats",
    "Reservation",
    "TensorBackend",
    "VirtualBuffer",
]
