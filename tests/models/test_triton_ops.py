"""The Triton decode kernels (rope + K/V write, paged decode attention), run on the host under
Triton's interpreter against the torch reference: the same kernels the GPU runs, compiled there
instead (tests/gpu/test_flashinfer_attention.py runs them on the GPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from models.attention.base import AttentionMetadata, ForwardContext, LayerAttention, SeqChunk
from models.attention.kv_write import RowsWriter
from models.attention.table_decode import TableDecodeAttention, TableDecodeGraphAttention
from models.attention.torch_paged import TorchPagedAttention
from models.kernels import triton_ops
from models.layers.rotary_embedding import RotaryEmbedding

pytest.importorskip("triton")
CPU = torch.device("cpu")
BLOCK = 16


@pytest.fixture(autouse=True)
def interpreter():
    if not triton_ops.triton_runs_on(CPU):
        pytest.skip("Triton's interpreter is off (tests/conftest.py turns it on without a GPU)")


def rotated(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in fp32 (GPT-NeoX halves), cast back."""
    half = x.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# (tokens, q heads, KV heads, head_dim): a decode step's one head a program; a prefill's
# several (2: as many as both head counts share; 8: the most)
ROPE_CASES = [(5, 8, 2, 64), (5, 8, 2, 96), (130, 8, 2, 64), (128, 16, 8, 96)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "t{}-hq{}-hkv{}-d{}".format(*c))
@pytest.mark.parametrize("out", ["in-place", "q-out", "qkv-out"])
def test_rope_write_rotates_q_and_k_and_stores_k_and_v_at_their_slots(case, out):
    """in-place: q and k turn where they lie; q-out: q into a contiguous tensor, k in place;
    qkv-out: q, k and v into contiguous tensors (a piecewise graph's buffers), k left as it was."""
    t, hq, hkv, head_dim = case
    contiguous_q = out != "in-place"
    torch.manual_seed(head_dim + t)
    assert triton_ops.heads_a_program(t, hq, hkv) == {5: 1, 130: 2, 128: 8}[t]
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k, v = (x.view(t, -1, head_dim) for x in (q, k, v))  # strided views of one projection
    positions = torch.randperm(4 * t)[:t]
    table = RotaryEmbedding(head_dim, 10000.0)(positions).table()
    want_q, want_k, want_v = rotated(q, table), rotated(k, table), v.clone()
    blocks_n = -(-2 * t // BLOCK) + 1
    cache = torch.zeros(blocks_n, 2, BLOCK, hkv, head_dim, dtype=torch.bfloat16)
    slots = torch.randperm(blocks_n * BLOCK)[:t]  # distinct slots, anywhere in the cache
    q_out = torch.empty(t, hq, head_dim, dtype=q.dtype) if contiguous_q else None
    kv_out = None
    if out == "qkv-out":
        kv_out = tuple(torch.empty(t, hkv, head_dim, dtype=k.dtype) for _ in "kv")
    k_in = k.clone()
    got = triton_ops.rope_write(q, k, v, table, slots, cache, q_out, kv_out)
    assert got.is_contiguous() is contiguous_q
    # within one bf16 rounding (the interpreter's casts truncate; the GPU's round to nearest)
    ulp = {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(got, want_q, **ulp)
    if kv_out is None:
        torch.testing.assert_close(k, want_k, **ulp)  # in place
        k_got = k
    else:
        assert torch.equal(k, k_in)  # left as it was
        k_got = kv_out[0]
        torch.testing.assert_close(k_got, want_k, **ulp)
        assert torch.equal(kv_out[1], want_v)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    assert torch.equal(cache[blocks, 0, offsets], k_got)
    assert torch.equal(cache[blocks, 1, offsets], want_v)
    written = torch.zeros(blocks_n, BLOCK, dtype=torch.bool)
    written[blocks, offsets] = True
    assert not cache.transpose(1, 2)[~written].any()  # nothing else touched


def decode_case(lens: list[int], hq: int, hkv: int, head_dim: int, seed: int):
    """A decode step over a random cache: md, the cache and a query [B, Hq, D]."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(64, 2, BLOCK, hkv, head_dim, generator=g).to(torch.bfloat16)
    perm = (torch.randperm(63, generator=g) + 1).tolist()  # block 0 is the null block
    chunks = []
    for n in lens:
        nb = -(-n // BLOCK)
        table, perm = perm[:nb], perm[nb:]
        chunks.append(SeqChunk(n - 1, 1, table))
    md = AttentionMetadata.build(chunks, BLOCK, CPU)
    q = torch.randn(len(lens), hq, head_dim, generator=g).to(torch.bfloat16)
    return md, cache, q


def reference(md, cache, q, spec) -> torch.Tensor:
    """The torch backend's output for the step (it writes the step's K/V first: hand it what
    the cache already holds there)."""
    at = md.slot_mapping
    k, v = cache[at // BLOCK, 0, at % BLOCK], cache[at // BLOCK, 1, at % BLOCK]
    ref = TorchPagedAttention([cache.clone()], md)
    return ref.forward(0, q.float(), k.float(), v.float(), spec)


SPECS = {
    "plain": LayerAttention(scale=0.125),
    "window": LayerAttention(scale=0.125, sliding_window=21),
    "softcap": LayerAttention(scale=0.125, logit_softcap=5.0),
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("sms", [1, 16, 64])  # one split, a few, as many as the tiles allow
def test_the_decode_kernel_matches_the_reference_however_it_splits(spec, sms):
    lens = [1, 16, 17, 130, 64 * 4 + 3]
    md, cache, q = decode_case(lens, hq=8, hkv=2, head_dim=64, seed=sms)
    kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU)
    kernel.sm_count = sms
    nsplit = kernel.splits(len(lens), md.block_tables.shape[1] * BLOCK)
    assert (nsplit == 1) is (sms == 1) and nsplit <= triton_ops.MAX_SPLITS
    got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
    want = reference(md, cache, q, spec)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert not kernel.tickets.any()  # every merge left its ticket at zero for the next launch


def test_the_split_aims_at_the_waves_asked_for():
    """B=16 of an 8B model (8 KV heads, 128 pairs) on 132 SMs: two waves split each pair's
    KV in 3, eight in 9; a split never holds less than a tile nor exceeds MAX_SPLITS."""
    for waves, want in ((2, 3), (8, 9), (64, triton_ops.MAX_SPLITS)):
        kernel = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, CPU, waves=waves)
        kernel.sm_count = 132
        assert kernel.splits(16, 1024) == want
        assert kernel.splits(16, 100) == 2  # 100 positions: two tiles of 64
        assert kernel.splits(1, 1024) == 16


@pytest.mark.parametrize("block_n", [16, 128])
def test_the_tile_knob(block_n):
    """Tiles of 16 and of 128 positions (the default is 64 at head_dim 64): the same attention,
    split or not; a tile not a power of 2 from 16 is refused."""
    lens = [1, 17, 130, 64 * 4 + 3]
    md, cache, q = decode_case(lens, hq=8, hkv=2, head_dim=64, seed=block_n)
    spec = LayerAttention(scale=0.125)
    want = reference(md, cache, q, spec)
    for sms in (1, 64):
        kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, block_n=block_n)
        kernel.sm_count = sms
        assert kernel.block_n == block_n
        got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        assert not kernel.tickets.any()
    for bad in (8, 48):
        with pytest.raises(ValueError, match="block_n"):
            triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, block_n=bad)


def test_a_launch_of_one_program_an_sm_takes_the_wide_tile():
    """Batch 1 of an 8B model on 132 SMs (16 splits x 8 KV heads: 128 programs) takes tiles
    of 128 positions, batch 2 (256 programs) block_n's 64; the wide tile is at most 128 x 128
    elements of K. Either way, the reference's attention."""
    kernel = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, CPU)
    kernel.sm_count = 132
    assert kernel.tile(1, kernel.splits(1, 1024)) == 128
    assert kernel.tile(2, kernel.splits(2, 1024)) == 64
    assert triton_ops.TritonDecodeKernel(4, 4, 256, BLOCK, CPU).tile(1, 1) == 64  # block_n 32
    big = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, CPU, block_n=128)
    assert big.tile(1, 1) == 128
    lens = [64 * 4 + 3, 130]
    md, cache, q = decode_case(lens, hq=8, hkv=2, head_dim=64, seed=9)
    spec = LayerAttention(scale=0.125)
    want = reference(md, cache, q, spec)
    for sms, tile in ((24, 128), (16, 64)):
        kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU)
        # 2 sequences x 2 KV heads x 5 splits: at most one program an SM (24), or more (16)
        kernel.sm_count = sms
        nsplit = kernel.splits(2, md.block_tables.shape[1] * BLOCK)
        assert nsplit == 5 and kernel.tile(2, nsplit) == tile
        got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        assert not kernel.tickets.any()


def test_the_warps_knob():
    """A program of 8 (or 2) warps: the same attention; other counts are refused."""
    md, cache, q = decode_case([130, 17], hq=8, hkv=2, head_dim=64, seed=4)
    spec = LayerAttention(scale=0.125)
    want = reference(md, cache, q, spec)
    for warps in (2, 8):
        kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, warps=warps)
        kernel.sm_count = 64
        got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        assert kernel.warps == warps and not kernel.tickets.any()
    for bad in (0, 3, 16):
        with pytest.raises(ValueError, match="warps"):
            triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, warps=bad)


def test_a_dense_launch_takes_its_own_warps_and_stages():
    """A launch of more programs than SMs (batches past one) runs under `dense`'s warps and
    stages, one of at most one program an SM under the kernel's; the same attention either
    way; a bad pair is refused."""
    md, cache, q = decode_case([130, 17], hq=8, hkv=2, head_dim=64, seed=5)
    spec = LayerAttention(scale=0.125)
    want = reference(md, cache, q, spec)
    kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU)
    kernel.sm_count = 4
    assert kernel.dense == triton_ops.DENSE_LAUNCH == (2, 2)
    assert kernel.settings(1, 2) == (kernel.warps, kernel.stages) == (4, 3)  # 2 programs
    assert kernel.settings(2, 2) == (2, 2)  # 8 programs on 4 SMs
    plain = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, dense=None)
    plain.sm_count = 4
    assert plain.settings(2, 2) == (4, 3)
    for k in (kernel, plain):
        got = k(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        assert not k.tickets.any()
    for bad in ((3, 2), (2, 0)):
        with pytest.raises(ValueError, match="dense launch"):
            triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, dense=bad)


@pytest.mark.slow
def test_more_splits_than_the_default_merge_holds():
    """max_splits 32 (a build whose merge holds 32 parts), tiles of 16 positions: a sequence of
    515 positions split 32 ways, against the reference; 0 and 65 splits are refused."""
    lens = [515, 40]
    md, cache, q = decode_case(lens, hq=8, hkv=2, head_dim=64, seed=5)
    spec = LayerAttention(scale=0.125)
    kernel = triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, max_splits=32, block_n=16)
    kernel.sm_count = 64
    assert kernel.splits(len(lens), md.block_tables.shape[1] * BLOCK) == 32
    assert kernel.merge_splits == 32 > triton_ops.MAX_SPLITS
    got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
    torch.testing.assert_close(got.float(), reference(md, cache, q, spec), atol=2e-2, rtol=2e-2)
    assert not kernel.tickets.any()
    for bad in (0, triton_ops.SPLITS_LIMIT + 1):
        with pytest.raises(ValueError, match="max_splits"):
            triton_ops.TritonDecodeKernel(8, 2, 64, BLOCK, CPU, max_splits=bad)


def test_a_query_group_of_one_and_head_dim_256():
    md, cache, q = decode_case([5, 40], hq=4, hkv=4, head_dim=256, seed=3)
    kernel = triton_ops.TritonDecodeKernel(4, 4, 256, BLOCK, CPU)
    spec = LayerAttention(scale=256**-0.5)
    got = kernel(q, cache, md.block_tables, md.seq_lens.view(-1, 1), spec)
    want = reference(md, cache, q, spec)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="powers of 2"):
        triton_ops.TritonDecodeKernel(4, 4, 96, BLOCK, CPU)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("path", ["in-attention", "rope-kernel"])
@pytest.mark.parametrize("graph", [False, True])
def test_a_decode_layer_through_the_context_ropes_writes_and_attends_like_the_reference(
    graph, path, spec
):
    """ForwardContext hands the rope to the table-decode backend: the attention kernel rotates
    q and k and stores K/V itself, or the writer's rope kernel does before it. The output and
    the cache equal rope, then the reference backend's step."""
    hq, hkv, d = 8, 2, 64
    md, cache, _ = decode_case([1, 33, 100], hq, hkv, d, seed=11)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(3, hq, d), k.view(3, hkv, d), v.view(3, hkv, d)
    rope = RotaryEmbedding(d, 10000.0)(md.seq_lens.long() - 1)
    ref_cache = cache.clone()
    want = TorchPagedAttention([ref_cache], md).forward(
        0, rotated(q, rope.table()), rotated(k, rope.table()), v.clone(), spec
    )
    kernel = triton_ops.TritonDecodeKernel(hq, hkv, d, BLOCK, CPU)
    kernel.sm_count = 64  # the longest sequence in three splits
    if path == "rope-kernel":  # a kernel that cannot take the rope: the writer's kernel does
        kernel = functools.partial(kernel)
    if graph:
        attn = TableDecodeGraphAttention(kernel, [cache], 4, 8, lambda s: RowsWriter(s, BLOCK))
        attn.plan(md)
        attn.prepare()
        pad = torch.zeros(1, qkv.shape[1], dtype=qkv.dtype)  # the graph's padded fourth row
        q2, k2, v2 = torch.cat((qkv, pad)).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q2.view(4, hq, d), k2.view(4, hkv, d), v2.view(4, hkv, d)
        rope = RotaryEmbedding(d, 10000.0)(torch.cat((md.seq_lens.long() - 1, torch.zeros(1))))
    else:
        attn = TableDecodeAttention(kernel, [cache], md, RowsWriter(md.slot_mapping, BLOCK))
    assert attn.takes_rope
    got = ForwardContext(attn=attn).attention(0, q, k, v, spec, rope)[:3]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    live = cache.clone()
    live[0] = ref_cache[0]  # the padded row wrote the null block; nothing else differs
    torch.testing.assert_close(live, ref_cache, atol=1e-6, rtol=2**-7)  # one bf16 rounding
    assert torch.equal(live[:, 1], ref_cache[:, 1])  # V as it came


def test_without_triton_here_the_context_ropes_first_and_the_writer_stores(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    md, cache, _ = decode_case([3, 20], 4, 2, 64, seed=2)
    writer = RowsWriter(md.slot_mapping, BLOCK)
    attn = TableDecodeAttention(None, [cache], md, writer)
    assert not attn.takes_rope  # the host without the interpreter: no Triton kernel runs here
    assert not writer.fuses_rope(cache)


@pytest.mark.slow
def test_a_model_load_builds_and_checks_the_kernel_or_says_why_not(monkeypatch):
    specs = list(SPECS.values())
    kernel, why = triton_ops.load_decode_kernel((8, 2), 64, BLOCK, CPU, specs, torch.bfloat16, True)
    assert why is None and isinstance(kernel, triton_ops.TritonDecodeKernel)
    assert not kernel.tickets.any()
    load = triton_ops.load_decode_kernel
    assert "head_dim 96" in load((8, 2), 96, BLOCK, CPU, specs, torch.bfloat16, True)[1]
    assert "8 query heads over 3" in load((8, 3), 64, BLOCK, CPU, specs, torch.bfloat16, True)[1]

    def broken(*a, **k):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_ops.TritonDecodeKernel, "__call__", broken)
    kernel, why = load((8, 2), 64, BLOCK, CPU, specs, torch.bfloat16, False)
    assert kernel is None and "PassManager::run failed" in why
    monkeypatch.delenv("TRITON_INTERPRET")
    assert load((8, 2), 64, BLOCK, CPU, specs, torch.bfloat16, False) == (
        None,
        "Triton does not run here",
    )
