"""The host-side inputs of the FlashInfer backend (no GPU needed): the CSR block tables plan()
reads, padding for CUDA graphs, the K/V rows the cache writes go to, the per-layer plan keywords;
and the fixed tables of the table-reading decode kernel's graphs."""

from __future__ import annotations

import functools
import random

import torch

from models.attention.base import AttentionMetadata, LayerAttention, SeqChunk
from models.attention.flashinfer_paged import (
    AttentionShape,
    PagedKVIndex,
    append_inputs,
    plan_kwargs,
)
from models.attention.kv_write import KVSlots, RowsWriter, kv_pairs, write_kv
from models.attention.table_decode import TableDecodeGraphAttention
from models.attention.torch_paged import TorchPagedAttention
from models.attention.upload import _packed, host_ints, pinned, upload

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


def test_a_mixed_batch_gets_every_tokens_slot_and_every_table_in_order():
    """Long and short chunks in any order, at any offset in a block: each token's slot is its
    block times the block size plus its offset, and the tables are padded with the null block."""
    gen = random.Random(7)
    for _ in range(50):
        chunks = []
        for _ in range(gen.randint(1, 6)):
            start, new = gen.randint(0, 90), gen.choice([1, 2, 16, 17, 40, 100])
            table = gen.sample(range(1, 500), -(-(start + new) // 16) + gen.randint(0, 2))
            chunks.append(SeqChunk(start, new, table))
        md = AttentionMetadata.build(chunks, 16, CPU)
        want = [
            c.block_table[p // 16] * 16 + p % 16
            for c in chunks
            for p in range(c.num_computed, c.num_computed + c.num_new)
        ]
        assert md.slot_mapping.tolist() == want and md.slot_mapping.dtype == torch.int64
        width = max(-(-(c.num_computed + c.num_new) // 16) for c in chunks)
        for row, c in zip(md.block_tables.tolist(), chunks):
            n = -(-(c.num_computed + c.num_new) // 16)
            assert row == c.block_table[:n] + [0] * (width - n)
        assert md.block_tables.dtype == torch.int32
        assert md.query_start_loc.tolist()[-1] == len(want)


def test_a_steps_tokens_and_positions_ride_with_its_metadata():
    """build_with hands back the riders (a step's positions, sampled rows and tokens) beside the
    metadata that build makes, values and dtypes unchanged."""
    chunks = [SeqChunk(0, 40, [3, 9, 4]), SeqChunk(17, 1, [5, 6])]
    riders = [torch.arange(41), torch.tensor([39, 40]), torch.arange(100, 141, dtype=torch.int32)]
    md, got = AttentionMetadata.build_with(chunks, 16, CPU, riders)
    want = AttentionMetadata.build(chunks, 16, CPU)
    assert torch.equal(md.slot_mapping, want.slot_mapping)
    assert torch.equal(md.block_tables, want.block_tables)
    assert md.query_lens_cpu == want.query_lens_cpu == [40, 1]
    assert len(got) == 3
    for r, g in zip(riders, got):
        assert torch.equal(r, g) and r.dtype == g.dtype
    assert AttentionMetadata.build_with(chunks, 16, CPU)[1] == []


def test_kv_writes_land_where_the_reference_backend_puts_them():
    """From separate k and v, and from k and v side by side in a qkv projection's rows (read
    where they lie, through one view)."""
    gen = torch.Generator().manual_seed(0)
    md = AttentionMetadata.build([SeqChunk(2, 5, [3, 7]), SeqChunk(0, 1, [10])], 4, CPU)
    qkv = torch.randn(6, (4 + 2 + 2) * 8, generator=gen)  # [T, (Hq + 2 Hkv) * D]
    _, k, v = (x.view(6, -1, 8) for x in qkv.split([32, 16, 16], dim=-1))
    assert kv_pairs(k, v) is not None and kv_pairs(k.clone(), v) is None
    assert kv_pairs(v, k) is None  # v before k: not one [T, 2, H, D] view
    apart = torch.randn(2, 1, 2, 8).unbind(0)  # one row each, side by side in one tensor
    assert kv_pairs(*apart) is not None
    assert kv_pairs(apart[0].clone(), apart[1]) is None  # another tensor's memory
    for kk, vv in ((k, v), (k.clone(), v.clone())):
        cache = torch.zeros(12, 2, 4, 2, 8)  # [blocks, K/V, block_size, heads, head_dim]
        ref = cache.clone()
        write_kv(cache, KVSlots.of(md.slot_mapping, 4), kk, vv)
        TorchPagedAttention([ref], md)._write(ref, kk, vv)
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


def test_the_table_decode_graph_tables_are_refilled_and_padded_rows_reset():
    """A batch of three, then one of two in the same graph: the live rows carry the step's
    tables, lengths and slots; the row that fell out reads and writes the null block only."""
    caches = [torch.zeros(64, 2, 16, 2, 16)]
    writer = functools.partial(RowsWriter, block_size=16)
    attn = TableDecodeGraphAttention(None, caches, 4, 6, writer)
    assert not attn.fits(AttentionMetadata.build([SeqChunk(6 * 16, 1, [1] * 7)], 16, CPU))
    three = [SeqChunk(40, 1, [5, 6, 7]), SeqChunk(3, 1, [9]), SeqChunk(70, 1, [1, 2, 3, 4, 8])]
    attn.plan(AttentionMetadata.build(three, 16, CPU))
    assert attn.tables[:3].tolist() == [[5, 6, 7, 0, 0, 0], [9, 0, 0, 0, 0, 0], [1, 2, 3, 4, 8, 0]]
    assert attn.lens.tolist() == [41, 4, 71, 1] and attn.seq_lens.shape == (4, 1)
    assert attn.slots.tolist() == [7 * 16 + 8, 9 * 16 + 3, 8 * 16 + 6, 0]
    two = [SeqChunk(16, 1, [11, 12]), SeqChunk(0, 1, [13])]
    attn.plan(AttentionMetadata.build(two, 16, CPU))
    assert attn.tables[:2, :2].tolist() == [[11, 12], [13, 0]]
    assert attn.tables[2:, 0].tolist() == [0, 0]  # the stale row's first block: the null block
    assert attn.lens.tolist() == [17, 1, 1, 1]
    assert attn.slots.tolist() == [12 * 16, 13 * 16, 0, 0]
    attn.prepare()  # where the static slots put each token's K/V
    assert attn.write.at.blocks.tolist() == [12, 13, 0, 0]
    assert attn.write.at.offsets.tolist() == [0, 0, 0, 0]


def test_host_ints_keep_every_value_and_its_type():
    big = [1, -(2**40), 2**62, 0]
    assert host_ints(big, torch.int64).tolist() == big
    assert host_ints([7, -3], torch.int32).dtype == torch.int32
    assert host_ints([], torch.int32).shape == (0,)
    a, b = upload([host_ints(big, torch.int64), torch.ones(2, 3)], CPU)
    assert a.tolist() == big and b.shape == (2, 3)


def test_packed_tensors_keep_their_values_from_aligned_offsets():
    ts = [torch.arange(5, dtype=torch.int32), torch.empty(0, dtype=torch.int64), -torch.ones(2, 3)]
    buf, offsets = _packed(ts, pin=False)
    assert offsets == [0, 32, 32] and buf.numel() == 32 + 32  # 20 -> 32 bytes; 0; 24 -> 32
    for t, off in zip(ts, offsets):
        n = t.numel() * t.element_size()
        assert torch.equal(buf[off : off + n].view(t.dtype).view(t.shape), t)
    # off a GPU, the index FlashInfer plans from stays as it is
    chunks = [SeqChunk(0, 5, [7]), SeqChunk(30, 3, [4, 9, 2, 8])]
    ix = PagedKVIndex.from_metadata(AttentionMetadata.build(chunks, 16, CPU))
    assert all(a is b for a, b in zip(vars(ix.pinned(CPU)).values(), vars(ix).values()))
    assert all(a is b for a, b in zip(pinned(ts, CPU), ts))
