"""kvpool: storage and mechanism. Physical pages shared by the models of a device (PagePool),
virtual buffers backed by them (PooledBuffer), the paged KV layout and cache, and best-fit block
placement. Which owner gives pages back is decided outside (the pool's reclaim order)."""

from kvpool.backend import MemoryBackend, PhysicalHandle, Reservation
from kvpool.block_allocator import BlockAllocator, PageMapper
from kvpool.cpu_backend import CpuBackend
from kvpool.cuda_backend import CudaBackend, CudaDriverError
from kvpool.host_copy import HostBudget, HostCopy, Transfer
from kvpool.kv_cache import KVCache
from kvpool.kv_layout import KVLayout
from kvpool.mirrored_pages import MirroredPages
from kvpool.page_pool import OwnerUsage, PagePool, PoolStats, ReclaimOrder
from kvpool.paged_kv import PagedKV, ShardedKV
from kvpool.pooled_buffer import PooledBuffer
from kvpool.sharded_weights import ShardedHostCopy, ShardedWeights
from kvpool.tensor_backend import TensorBackend
from kvpool.virtual_buffer import VirtualBuffer
from kvpool.weight_buffer import WeightBuffer, WeightLayout, WeightSlot, map_and_load

__all__ = [
    "BlockAllocator",
    "CpuBackend",
    "CudaBackend",
    "CudaDriverError",
    "HostBudget",
    "HostCopy",
    "Transfer",
    "KVCache",
    "KVLayout",
    "MemoryBackend",
    "MirroredPages",
    "OwnerUsage",
    "PageMapper",
    "PagedKV",
    "ShardedHostCopy",
    "ShardedKV",
    "ShardedWeights",
    "PagePool",
    "PhysicalHandle",
    "PoolStats",
    "PooledBuffer",
    "ReclaimOrder",
    "Reservation",
    "TensorBackend",
    "VirtualBuffer",
    "WeightBuffer",
    "WeightLayout",
    "WeightSlot",
    "map_and_load",
]
