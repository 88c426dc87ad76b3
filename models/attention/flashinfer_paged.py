"""FlashInfer paged attention (GPU): plan once per step, run once per layer.

Cache view per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (NHD, K and V in one
tensor: FlashInfer's single-tensor form; page_size = block_size). Every layer shares the step's
block tables, so plan() runs once per step for each distinct kind of layer (softmax scale, sliding
window, logit soft cap: a Gemma 3 model has two) and run() once per layer.

- Decode-only steps: Prism's Triton kernel for steps of at most
  `KernelConfig.decode_backend_max_batch` sequences (triton_ops), where it runs; else
  BatchDecodeWithPagedKVCacheWrapper with tensor cores.
- Steps of fresh prompts only (every chunk starts at position 0: nothing cached before it): the
  BatchPrefillWithRaggedKVCacheWrapper over the step's own K/V tensors, causal. The K/V are
  still written to the cache, for the decodes that follow; attention does not read them back.
  Their plan needs only the query rows, so the step builds no block index before its first
  kernel (the host's time there is the device's idle time for a lone prompt).
- Anything else (prefill chunks over a cached prefix, mixed with decodes): the
  BatchPrefillWithPagedKVCacheWrapper, causal (FlashInfer aligns each query chunk to the end of
  its sequence). Ragged, paged and tensor-core decode share one JIT module per (dtype, head_dim,
  window?, soft cap?).
- CUDA graphs: `DecodeGraphAttention`, one per captured batch size, owns fixed index buffers that
  plan() refills outside the graph before each replay; padded rows read and write the null block.
- Decode through the Triton kernel (see triton_ops): one kernel per layer, reading the block
  table itself (table_decode); a model it cannot run (head_dim not a power of 2, no Triton)
  keeps FlashInfer's.
- Decode steps and steps of fresh prompts rotate q and k and write K/V in one Triton kernel over
  the step's slots (see kv_write), where Triton runs; prefill chunks over a cached prefix (and
  every step where Triton does not run) take FlashInfer's rope and append.

NOTE: `LayerAttention.sliding_window` counts the positions attended including the query's own;
FlashInfer's window_left excludes it, so window_left = sliding_window - 1.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.attention.base import AttentionMetadata, LayerAttention
from models.attention.kv_write import RowsWriter, rope_then_write
from models.attention.table_decode import TableDecodeAttention, TableDecodeGraphAttention
from models.attention.upload import host_ints, pinned, upload
from models.kernels import triton_ops
from models.kernels.tuning import KernelConfig

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-kv partials)


@functools.cache
def flashinfer_available() -> bool:
    """Whether FlashInfer imports here (it needs CUDA; JIT compiles kernels on first use)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class AttentionShape:
    """What FlashInfer's plan needs to know about a model's attention."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block = FlashInfer's page_size
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


DEFAULT_KERNELS = KernelConfig()


@dataclass
class PagedKVIndex:
    """A step's block tables in FlashInfer's CSR form (host int32 tensors)."""

    qo_indptr: torch.Tensor  # [B + 1]: query rows of each sequence
    kv_indptr: torch.Tensor  # [B + 1]: blocks of each sequence in kv_indices
    kv_indices: torch.Tensor  # [nnz] block indices, sequence after sequence
    last_page_len: torch.Tensor  # [B] tokens in each sequence's last block (1..block_size)

    @staticmethod
    def from_metadata(md: AttentionMetadata, pad_to: int = 0) -> PagedKVIndex:
        """Built from md's host copies; pad_to > B appends sequences of one token in block 0."""
        bs = md.block_size
        seq = torch.tensor(md.seq_lens_cpu, dtype=torch.int32)
        qlen = torch.tensor(md.query_lens_cpu, dtype=torch.int32)
        nblocks = (seq + bs - 1) // bs
        tables = md.block_tables_cpu
        used = torch.arange(tables.shape[1], dtype=torch.int32) < nblocks.unsqueeze(1)
        # NOTE: masked_select, not tables[used]: boolean indexing goes through nonzero(), which
        # took 8 ms on the host for a 64 x 70 table (masked_select: 22 us).
        indices = tables.masked_select(used)  # row-major: sequence after sequence
        last = seq - (nblocks - 1) * bs
        pad = max(0, pad_to - len(seq))
        if pad:
            ones = torch.ones(pad, dtype=torch.int32)
            qlen = torch.cat((qlen, ones))
            nblocks = torch.cat((nblocks, ones))
            last = torch.cat((last, ones))
            indices = torch.cat((indices, torch.zeros(pad, dtype=torch.int32)))
        zero = torch.zeros(1, dtype=torch.int32)
        return PagedKVIndex(
            qo_indptr=torch.cat((zero, qlen.cumsum(0, dtype=torch.int32))),
            kv_indptr=torch.cat((zero, nblocks.cumsum(0, dtype=torch.int32))),
            kv_indices=indices,
            last_page_len=last,
        )

    def pinned(self, device: torch.device) -> PagedKVIndex:
        """The same index in pinned host memory when `device` is a GPU (`upload.pinned`): the
        copies FlashInfer's plan() makes of it do not hold the host."""
        return PagedKVIndex(
            *pinned((self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len), device)
        )


def query_indptr(query_lens: Sequence[int]) -> torch.Tensor:
    """[B + 1] host int32: where each sequence's query rows start, then their total."""
    return host_ints([0, *itertools.accumulate(query_lens)], torch.int32)


def plan_kwargs(spec: LayerAttention, shape: AttentionShape) -> dict:
    """The plan() keywords of one kind of layer (everything after page_size is keyword-only)."""
    return {
        "sm_scale": spec.scale,
        "window_left": spec.sliding_window - 1 if spec.sliding_window else -1,
        "logits_soft_cap": spec.logit_softcap or 0.0,
        "q_data_type": shape.q_dtype,
        "kv_data_type": shape.kv_dtype,
    }


def append_inputs(index: PagedKVIndex, md: AttentionMetadata, device) -> list[torch.Tensor]:
    """Device inputs of flashinfer.append_paged_kv_cache for a step, built on the host and copied
    in one transfer: [batch_indices, positions, kv_indices, kv_indptr, last_page_len]."""
    qlen = index.qo_indptr[1:] - index.qo_indptr[:-1]
    seq = torch.tensor(md.seq_lens_cpu, dtype=torch.int32)
    b, t = len(qlen), int(index.qo_indptr[-1])
    batch = torch.repeat_interleave(torch.arange(b, dtype=torch.int32), qlen)
    # token j of sequence i sits at position seq_i - qlen_i + j
    offset = torch.repeat_interleave(seq - qlen - index.qo_indptr[:-1], qlen)
    positions = torch.arange(t, dtype=torch.int32) + offset
    pages = (index.kv_indices, index.kv_indptr, index.last_page_len)
    return upload((batch, positions, *pages), device)


class AppendWriter:
    """K/V writes through flashinfer.append_paged_kv_cache (prefill chunks: 2.8x faster than
    index_copy_ for 8k tokens on the H200)."""

    def __init__(self, fi, args: list[torch.Tensor]):
        self.fi = fi
        self.batch_indices, self.positions, self.indices, self.indptr, self.last = args

    def __call__(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.fi.append_paged_kv_cache(
            k, v, self.batch_indices, self.positions, cache, self.indices, self.indptr, self.last
        )


class FlashInferBackend:
    """One model's FlashInfer state: a float workspace shared by all its wrappers, one prefill and
    one decode wrapper per kind of layer. Calling it is the runner's per-step AttentionFactory.

    `workspace` (uint8, >= WORKSPACE_BYTES) may be shared by every model of a device whose steps
    run one at a time on one stream (the workspace only holds a step's split-kv partials)."""

    def __init__(
        self,
        shape: AttentionShape,
        specs: Sequence[LayerAttention],
        device: torch.device,
        workspace: torch.Tensor | None = None,
        kernels: KernelConfig = DEFAULT_KERNELS,
    ):
        import flashinfer

        self._fi = flashinfer
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the kernels bind to one device
            device = torch.device("cuda", torch.cuda.current_device())
        self.shape, self.specs, self.device = shape, list(specs), device
        self.kernels = kernels
        if workspace is None:
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.workspace = workspace
        # by backend: fa2's for steps under prefill_backend_min_tokens, the chosen one's above
        # ("auto" off Hopper is fa2: one set; each wrapper holds 8 MiB of device workspace)
        large = kernels.prefill_backend
        hopper = getattr(flashinfer.utils, "is_sm90a_supported", None)
        if large == "auto" and (device.type != "cuda" or hopper is None or not hopper(device)):
            large = "fa2"
        self._large_prefill = large
        backends = {large} | ({"fa2"} if kernels.prefill_backend_min_tokens > 0 else set())
        self.prefill = {
            b: {
                s: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=b)
                for s in self.specs
            }
            for b in backends
        }
        self.ragged = {
            b: {
                s: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=b)
                for s in self.specs
            }
            for b in backends
        }
        self.decode = {
            s: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True
            )
            for s in self.specs
        }
        # decode through the Triton kernel, which reads the block table itself (None:
        # FlashInfer's for every batch)
        self.table_kernel: triton_ops.TritonDecodeKernel | None = None
        if kernels.decode_backend_max_batch > 0:
            self.table_kernel = self._triton_decode()

    @property
    def prefill_backends(self) -> tuple[str, ...]:
        """The prefill backends steps can run (fa2 for the small ones, the chosen one's above)."""
        return tuple(sorted(self.prefill))

    def __call__(
        self,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
        write_kv: bool = True,
        prefill_backend: str | None = None,
    ) -> FlashInferAttention:
        """The step's attention, planned for md. write_kv False: the step's K/V are written by
        someone else before each layer's call (a piecewise graph). prefill_backend: one of
        prefill_backends for a prefill or mixed step (None: the kernel choice's for its size)."""
        sh = self.shape
        decode = md.is_decode_only
        if decode and self._table_decodes(md.num_seqs):  # reads md's block tables as they are
            write = RowsWriter(md.slot_mapping, sh.block_size) if write_kv else None
            return TableDecodeAttention(self.table_kernel, kv_caches, md, write)
        if not decode and md.seq_lens_cpu == md.query_lens_cpu:
            return self._ragged(kv_caches, md, write_kv, prefill_backend)
        index = PagedKVIndex.from_metadata(md).pinned(self.device)
        if decode:
            write = RowsWriter(md.slot_mapping, sh.block_size) if write_kv else None
            wrappers = self.decode
            for spec, w in wrappers.items():
                w.plan(
                    index.kv_indptr,
                    index.kv_indices,
                    index.last_page_len,
                    sh.num_qo_heads,
                    sh.num_kv_heads,
                    sh.head_dim,
                    sh.block_size,
                    **plan_kwargs(spec, sh),
                )
        else:
            write = (
                AppendWriter(self._fi, append_inputs(index, md, self.device)) if write_kv else None
            )
            wrappers = self.prefill[self._prefill_backend(md, prefill_backend)]
            for spec, w in wrappers.items():
                w.plan(
                    index.qo_indptr,
                    index.kv_indptr,
                    index.kv_indices,
                    index.last_page_len,
                    sh.num_qo_heads,
                    sh.num_kv_heads,
                    sh.head_dim,
                    sh.block_size,
                    causal=True,
                    **plan_kwargs(spec, sh),
                )
        return FlashInferAttention(kv_caches, wrappers, write)

    def _prefill_backend(self, md: AttentionMetadata, asked: str | None) -> str:
        """The prefill backend of md's step: `asked`, else the kernel choice's for its size."""
        backend = asked or self.kernels.prefill_backend_for(md.num_tokens)
        return self._large_prefill if backend == self.kernels.prefill_backend else backend

    def _ragged(
        self, kv_caches, md: AttentionMetadata, write_kv: bool, asked: str | None
    ) -> RaggedAttention:
        """A step of fresh prompts: the ragged wrappers planned over their query rows alone
        (each prompt attends to its own rows). Its K/V write: one Triton kernel over the slots
        with the rope where it runs (no block index, no append inputs: host time before the
        step's first kernel), else FlashInfer's append."""
        sh = self.shape
        write = None
        if write_kv:
            write = RowsWriter(md.slot_mapping, sh.block_size)
            if not write.fuses_rope(kv_caches[0]):
                index = PagedKVIndex.from_metadata(md).pinned(self.device)
                write = AppendWriter(self._fi, append_inputs(index, md, self.device))
        rows = pinned([query_indptr(md.query_lens_cpu)], self.device)[0]
        ragged = self.ragged[self._prefill_backend(md, asked)]
        for spec, w in ragged.items():
            w.plan(
                rows,
                rows,
                sh.num_qo_heads,
                sh.num_kv_heads,
                sh.head_dim,
                causal=True,
                **{**plan_kwargs(spec, sh), "kv_data_type": sh.q_dtype},  # k, v as q
            )
        return RaggedAttention(kv_caches, ragged, write)

    def _table_decodes(self, batch: int) -> bool:
        """Whether a decode step of `batch` sequences runs the table-reading kernel."""
        return self.table_kernel is not None and batch <= self.kernels.decode_backend_max_batch

    def _triton_decode(self) -> triton_ops.TritonDecodeKernel | None:
        sh = self.shape
        kernel, why = triton_ops.load_decode_kernel(
            (sh.num_qo_heads, sh.num_kv_heads),
            sh.head_dim,
            sh.block_size,
            self.device,
            self.specs,
            sh.kv_dtype,
            rope=True,
            max_splits=self.kernels.triton_max_splits,
            stages=self.kernels.triton_stages,
            waves=self.kernels.triton_waves,
            warps=self.kernels.triton_warps,
            dense=self.kernels.triton_dense,
        )
        if why is not None:
            log.warning("decode attention through FlashInfer: the Triton kernel cannot run %s", why)
        return kernel

    def graph_attention(
        self, kv_caches: list[torch.Tensor], batch_size: int, max_blocks: int
    ) -> DecodeGraphAttention | TableDecodeGraphAttention:
        if self._table_decodes(batch_size):
            writer = functools.partial(RowsWriter, block_size=self.shape.block_size)
            return TableDecodeGraphAttention(
                self.table_kernel, kv_caches, batch_size, max_blocks, writer
            )
        return DecodeGraphAttention(self, kv_caches, batch_size, max_blocks)


class FlashInferAttention:
    """The AttentionBackend of one step: writes K/V, then runs the planned wrapper of the layer."""

    def __init__(self, kv_caches: list[torch.Tensor], wrappers: dict, write):
        self.kv_caches, self.wrappers, self.write = kv_caches, wrappers, write

    @property
    def takes_rope(self) -> bool:
        """Whether forward() can take the layer's rope with its K/V write (ForwardContext)."""
        return isinstance(self.write, RowsWriter) and self.write.fuses_rope(self.kv_caches[0])

    def forward(
        self, layer_idx: int, q, k, v, spec: LayerAttention, rope=None, out=None
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]; rope: q and k not yet rotated; out:
        # where to put the output (a piecewise graph's static buffer; None: a new tensor)
        cache = self.kv_caches[layer_idx]
        q = rope_then_write(self.write, cache, q, k, v, rope)
        return self.wrappers[spec].run(q, cache, out=out)


class RaggedAttention(FlashInferAttention):
    """A step of fresh prompts: writes K/V for later steps (with the rope, in one kernel, where
    the writer takes it), attends over the step's own K/V."""

    def forward(
        self, layer_idx: int, q, k, v, spec: LayerAttention, rope=None, out=None
    ) -> torch.Tensor:
        q = rope_then_write(self.write, self.kv_caches[layer_idx], q, k, v, rope)
        return self.wrappers[spec].run(q, k, v, out=out)


class DecodeGraphAttention(FlashInferAttention):
    """Decode attention for one captured batch size. Its buffers never move: plan() (outside the
    graph) refills them for the real batch padded to `batch_size`; prepare() (inside the graph)
    turns the static slot buffer into K/V rows."""

    def __init__(
        self,
        backend: FlashInferBackend,
        kv_caches: list[torch.Tensor],
        batch_size: int,
        max_blocks: int,
    ):
        dev = backend.device
        self.backend, self.batch_size, self.max_blocks = backend, batch_size, max_blocks
        self.indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(batch_size * max_blocks, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.slots = torch.zeros(batch_size, dtype=torch.int64, device=dev)  # [bs] static
        wrappers = {
            s: backend._fi.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=self.indptr,
                paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len,
            )
            for s in backend.specs
        }
        super().__init__(kv_caches, wrappers, write=None)

    def fits(self, md: AttentionMetadata) -> bool:
        return md.num_seqs <= self.batch_size and md.block_tables.shape[1] <= self.max_blocks

    def plan(self, md: AttentionMetadata) -> None:
        """Refill the buffers for md's decode batch (padded with one-token sequences in block 0)."""
        assert md.is_decode_only and self.fits(md), (md.num_seqs, self.batch_size)
        index = PagedKVIndex.from_metadata(md, pad_to=self.batch_size).pinned(self.indices.device)
        n, b = len(index.kv_indices), md.num_seqs
        self.indices[:n].copy_(index.kv_indices, non_blocking=True)
        self.slots[:b].copy_(md.slot_mapping)
        if b < self.batch_size:
            self.slots[b:].zero_()  # padded rows write the null block
        sh = self.backend.shape
        for spec, w in self.wrappers.items():
            w.plan(
                index.kv_indptr,
                self.indices[:n],
                index.last_page_len,
                sh.num_qo_heads,
                sh.num_kv_heads,
                sh.head_dim,
                sh.block_size,
                **plan_kwargs(spec, sh),
            )

    def prepare(self) -> None:
        """Per-step work that belongs inside the graph: K/V rows from the static slots."""
        self.write = RowsWriter(self.slots, self.backend.shape.block_size)
