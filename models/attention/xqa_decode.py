"""Decode attention through TensorRT-LLM's XQA kernel (shipped in FlashInfer), GPU only.

One kernel per layer and step: it reads each sequence's pages straight from the block table
([B, max_blocks] int32, the table kvpool's allocator fills) and the lengths, so a step needs no
plan and no CSR index. When the batch is too small to fill the GPU it splits each sequence over
several thread blocks and merges the parts itself (semaphores in its own workspace), where
FlashInfer's split-KV decode runs a second kernel per layer to merge them. Measured on the H200
with a bf16 cache (docs/BENCHMARKS.md), it is slower than FlashInfer's tensor-core decode: 0.66
against 0.40 ms of attention in an 8B model's batch-1 step (a bf16 cache runs TensorRT-LLM's
generic kernel; its Hopper kernel is for fp8 caches). So it is a choice, not the default.

What it needs: a page size of 16, 32, 64 or 128 tokens, a head_dim that is a multiple of 16 up
to 256, whole query-head groups, no logit soft cap (`xqa_unsupported`), a Hopper or Blackwell GPU,
and its kernels built (`load_xqa`: at model load, so a shape it cannot compile falls back too).
A model it cannot run decodes through FlashInfer. Its query and output are contiguous
[B, Hq, D]; a strided query is copied.

One device per process: a kernel module sets its shared-memory limit once, when it loads, for
the device current then (a CUDA function attribute is per device), so XQA runs on the first
device that loads it, and models on other devices keep FlashInfer's decode.

Cache view per layer: [num_blocks, 2, block_size, H, D]; K and V are its two halves, with the
same strides, which the kernel takes as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from models.attention.base import LayerAttention

XQA_WORKSPACE_BYTES = 32 << 20  # a lane's XQA workspace: semaphores, then the split parts
_SEMAPHORE_BYTES = 8 << 20  # zeroed once; every launch leaves them zero again
XQA_PAGE_SIZES = (16, 32, 64, 128)


def xqa_unsupported(
    block_size: int,
    head_dim: int,
    specs: Sequence[LayerAttention],
    dtype: torch.dtype,
    heads: tuple[int, int] = (1, 1),
) -> str | None:
    """Why the XQA kernel cannot run a model's decode attention (None: it can, if it builds).
    heads: (query heads, KV heads)."""
    if block_size not in XQA_PAGE_SIZES:
        return f"block size {block_size} (XQA pages: {', '.join(map(str, XQA_PAGE_SIZES))})"
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} (XQA: a multiple of 16, at most 256)"
    if heads[0] % heads[1]:
        return f"{heads[0]} query heads over {heads[1]} KV heads (XQA: whole groups)"
    if any(s.logit_softcap for s in specs):
        return "a logit soft cap"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} (XQA: bf16 or fp16)"
    return None


_bound: list[torch.device] = []  # the device XQA's kernels are set up for in this process
_bind_lock = threading.Lock()


def load_xqa(
    device: torch.device,
    modules: Sequence[tuple],
    build: Callable[[tuple], object] | None = None,
) -> str | None:
    """Build and load XQA's kernel modules for one model on `device`; why it cannot run there
    (None: ready). modules: get_xqa_module's arguments, one tuple per kind of layer. The first
    device to load a module binds XQA to itself; a later device is refused (see the module's
    doc). `build` stands in for FlashInfer's loader where there is no GPU."""
    with _bind_lock:
        if _bound and _bound[0] != device:
            return (
                f"{device}: XQA's kernels are set up for {_bound[0]} in this process (a module "
                "sets its shared-memory limit for one device)"
            )
        if build is None:
            major = torch.cuda.get_device_capability(device)[0]
            if major not in (9, 10, 12):
                return f"compute capability {major}.x (XQA: Hopper or Blackwell)"
            from flashinfer.xqa import get_xqa_module

            def build(args: tuple) -> object:
                with torch.cuda.device(device):  # the device current while the module loads
                    return get_xqa_module(*args)

        try:
            for args in modules:
                build(args)
        except Exception as e:  # noqa: BLE001 (a shape the kernel does not compile: fall back)
            return f"its kernel did not build ({type(e).__name__}: {str(e)[:200]})"
        _bound[:] = [device]
    return None


def xqa_modules(
    dtype: torch.dtype, block_size: int, head_dim: int, heads: tuple[int, int], specs
) -> list[tuple]:
    """get_xqa_module's arguments for a model: one module with a sliding window, one without,
    as its layers need them (a decode query is one token a sequence)."""
    ratio = heads[0] // heads[1]
    windows = sorted({bool(s.sliding_window) for s in specs})
    return [(dtype, dtype, block_size, head_dim, ratio, w, dtype, 1) for w in windows]


class XqaKernel:
    """What every XQA launch of one model shares: the kernel, the model's head shape, the lane's
    workspace split into its two parts, and the device's SM count (the kernel's split depends
    on it)."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, workspace: torch.Tensor):
        from flashinfer.xqa import xqa

        assert workspace.numel() >= XQA_WORKSPACE_BYTES and workspace.dtype == torch.uint8
        self._xqa = xqa
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.semaphores = workspace[:_SEMAPHORE_BYTES]
        self.scratch = workspace[_SEMAPHORE_BYTES:]
        props = torch.cuda.get_device_properties(workspace.device)
        self.sm_count = props.multi_processor_count

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        """q: [B, Hq, D]; cache: one layer's view; tables: [B, W] int32 (row-major, W pages a
        row: the kernel's longest sequence is W * block_size); seq_lens: [B, 1] int32 ->
        [B, Hq, D]."""
        if not q.is_contiguous():
            q = q.contiguous()
        out = torch.empty_like(q)
        k_cache, v_cache = cache.unbind(1)  # [num_blocks, block_size, H, D] each
        self._xqa(
            q.unsqueeze(1),  # [B, beam 1, Hq, D]
            k_cache,
            v_cache,
            tables,
            seq_lens,
            out.unsqueeze(1),
            self.scratch,
            self.semaphores,
            self.num_kv_heads,
            self.block_size,
            # the kernel scales q.k by q_scale / sqrt(head_dim)
            q_scale=spec.scale * self.head_dim**0.5,
            sliding_win_size=spec.sliding_window or 0,  # positions attended, the query's own too
            kv_layout="NHD",
            sm_count=self.sm_count,
        )
        return out
