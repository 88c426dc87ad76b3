"""kvpool: physical pages shared by the models of a device, virtual buffers, paged KV caches."""

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation
from kvpool.block_allocator import BlockAllocator
from kvpool.cpu_backend import CpuBackend
from kvpool.kv_cache import KVCache
from kvpool.kv_layout import KVLayout
from kvpool.page_pool import PagePool, PoolStats
from kvpool.virtual_buffer import VirtualBuffer

__all__ = [
    "BlockAllocator",
    "CpuBackend",
    "KVCache",
    "KVLayout",
    "MemoryBackend",
    "PagePool",
    "PhysicalHandle",
    "PoolStats",
    "Reservation",
    "VirtualBuffer",
]
