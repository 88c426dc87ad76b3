"""The host-side inputs of the FlashInfer backend (no GPU needed): the CSR block tables plan()
reads, padding for CUDA graphs, the K/V rows the cache writes go to, the per-layer plan keywords."""

from __future__ import annotations

import torch

from models.attention.base import AttentionMetadata, LayerAttention, SeqChunk
from models.attention.flashinfer_paged import (
    AttentionShape,
    PagedKVIndex,
    append_inputs,
    kv_rows,
    plan_kwargs,
    write_kv,
)
from models.attention.torch_paged import TorchPagedAttention

CPU = torch.device("cpu")


def test_index_is_the_block_tables_in_csr_form():
    chunks = [SeqChunk(0, 5, [7]), SeqChunk(30, 3, [4, 9, 2, 8]), SeqChunk(15, 1, [3, 6])]
    md = AttentionMetadata.build(chunks, 16, CPU)
    ix = PagedKVIndex.from_metadata(md)
    assert ix.qo_indptr.tolist() == [0, 5, 8, 9]
    assert ix.kv_indptr.tolist() == [0, 1, 4, 5]  # 5 -> 1 block, 33 -> 3 blocks, 16 -> 1 block
    assert ix.kv_indices.tolist() == [7, 4, 9, 2, 3]
    assert ix.last_page_len.tolist() == [5, 1, 16]
    assert all(t.dtype == torch.int32 for t in vars(ix).values())


def test_append_inputs_give_each_new_token_its_sequence_and_position():
    chunks = [SeqChunk(0, 5, [7]), SeqChunk(30, 3, [4, 9, 2, 8]), SeqChunk(15, 1, [3, 6])]
    md = AttentionMetadata.build(chunks, 16, CPU)
    batch, pos, indices, indptr, last = append_inputs(PagedKVIndex.from_metadata(md), md, CPU)
    assert batch.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2]
    assert pos.tolist() == [0, 1, 2, 3, 4, 30, 31, 32, 15]
    assert indices.tolist() == [7, 4, 9, 2, 3] and indptr.tolist() == [0, 1, 4, 5]
    assert last.tolist() == [5, 1, 16]


def test_index_padded_for_a_graph_adds_one_token_sequences_in_the_null_block():
    md = AttentionMetadata.build([SeqChunk(20, 1, [5, 6]), SeqChunk(3, 1, [9])], 16, CPU)
    ix = PagedKVIndex.from_metadata(md, pad_to=4)
    assert ix.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert ix.kv_indices.tolist() == [5, 6, 9, 0, 0]
    assert ix.last_page_len.tolist() == [5, 4, 1, 1]
    assert ix.qo_indptr.tolist() == [0, 1, 2, 3, 4]


def test_long_chunks_get_the_same_slots_as_short_ones():
    table = [11, 3, 8, 5]
    long = AttentionMetadata.build([SeqChunk(9, 40, table)], 16, CPU).slot_mapping.tolist()
    short = [
        AttentionMetadata.build([SeqChunk(p, 1, table)], 16, CPU).slot_mapping.item()
        for p in range(9, 49)
    ]
    assert long == short


def test_kv_writes_land_where_the_reference_backend_puts_them():
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(12, 2, 4, 2, 8)  # [blocks, K/V, block_size, heads, head_dim]
    ref = cache.clone()
    md = AttentionMetadata.build([SeqChunk(2, 5, [3, 7]), SeqChunk(0, 1, [10])], 4, CPU)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    write_kv(cache, kv_rows(md.slot_mapping, 4), k, v)
    TorchPagedAttention([ref], md)._write(ref, k, v)
    assert torch.equal(cache, ref) and cache.abs().sum() > 0


def test_plan_keywords_translate_the_window_and_soft_cap():
    shape = AttentionShape(8, 2, 256, 16, torch.bfloat16, torch.bfloat16)
    full = plan_kwargs(LayerAttention(scale=0.0625), shape)
    assert full["window_left"] == -1 and full["logits_soft_cap"] == 0.0
    assert full["sm_scale"] == 0.0625 and full["q_data_type"] is torch.bfloat16
    spec = LayerAttention(scale=0.0625, sliding_window=512, logit_softcap=50.0)
    sliding = plan_kwargs(spec, shape)
    assert sliding["window_left"] == 511  # the window counts the query itself; window_left not
    assert sliding["logits_soft_cap"] == 50.0
