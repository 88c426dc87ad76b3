"""The LoRA kernels (shrink, expand) under Triton's interpreter, against the per-slot torch GEMMs
(TorchLoraBatch, the CPU's path): tokens of several slots and of none, in any order, one token a
slot (decode) or segments (prefill) of several tiles, adapters of different ranks leaving some
shards of a merged projection alone, K split in parts; the graph input's static buffer refilled
between "replays". (On a GPU, in bf16, and decode graphs with LoRA: tests/gpu/test_lora_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.kernels.triton_lora import expand, max_tiles, pack_groups, parts_block, shrink
from models.layers.merged_linear import MergedLinear
from models.lora import NO_ADAPTER, KernelLoraBatch, LoraSlots, TorchLoraBatch
from tests.models.lora_cases import random_weights

pytest.importorskip("triton")

CPU = torch.device("cpu")
N = NO_ADAPTER


class _Attention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.qkv_proj = MergedLinear(hidden, {"q_proj": 96, "k_proj": 32, "v_proj": 32})
        self.o_proj = nn.Linear(96, hidden)


class _Mlp(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": 80, "up_proj": 80})
        self.down_proj = nn.Linear(80, hidden)


class _Base(nn.Module):
    """A layer's projections, hidden 320 (the shrink of qkv and gate_up splits K in parts)."""

    def __init__(self, dtype: torch.dtype, hidden: int = 320):
        super().__init__()
        self.self_attn = _Attention(hidden)
        self.mlp = _Mlp(hidden)
        self.to(dtype)


# slot -> the adapter's rank per HF projection (absent: left alone)
ADAPTERS = {
    0: {"q_proj": 4, "k_proj": 4, "v_proj": 4, "o_proj": 4, "gate_proj": 4, "down_proj": 4},
    1: {"k_proj": 2, "v_proj": 2},  # two of qkv's three shards
    2: {"q_proj": 16, "k_proj": 8, "v_proj": 12, "up_proj": 16, "down_proj": 16},
    3: {"q_proj": 8, "o_proj": 8, "gate_proj": 8, "up_proj": 2},
}


def _slots(base: nn.Module, dtype: torch.dtype) -> tuple[LoraSlots, LoraSlots]:
    """(the kernels' slots, the torch GEMMs' slots) of the same adapters, slots 0..3 of 5."""
    g = torch.Generator().manual_seed(7)
    ker = LoraSlots(base, num_slots=5, max_rank=16, kernels=True)
    ref = LoraSlots(base, num_slots=5, max_rank=16, kernels=False)
    for slot, ranks in ADAPTERS.items():
        w = random_weights(base, ranks, g, std=0.3, dtype=dtype)
        ker.assign(slot, w)
        ref.assign(slot, w)
    return ker, ref


STEPS = {
    # one token a sequence: slots out of order, the base's tokens between
    "decode": [2, N, 0, 3, 1, 0, N, 2],
    # a prefill's segments (slot 2's of two 16-token tiles) beside decodes
    "prefill": [3] * 5 + [N] * 3 + [2] * 20 + [0] + [1] * 6 + [2],
    # one slot's tokens over more than one 64-token tile, and a lone base token
    "long": [1] * 70 + [N] + [3] * 2,
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.float().abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert err <= TOL[dtype] * max(scale, 1.0), (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_the_kernels_add_what_the_torch_gemms_add(dtype, step):
    token_slots = STEPS[step]
    base = _Base(dtype)
    ker, ref = _slots(base, dtype)
    got, want = ker.batch(token_slots, CPU), ref.batch(token_slots, CPU)
    assert isinstance(got, KernelLoraBatch) and isinstance(want, TorchLoraBatch)
    assert got.token_slots.tolist() == token_slots
    g = torch.Generator().manual_seed(len(token_slots))
    base_rows = [i for i, s in enumerate(token_slots) if s == N]
    adapted = 0
    for name, module in base.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        x = torch.randn(len(token_slots), module.in_features, generator=g).to(dtype)
        y = torch.randn(len(token_slots), module.out_features, generator=g).to(dtype)
        out, ref_out = got.add(module, x, y.clone()), want.add(module, x, y.clone())
        _close(out, ref_out, dtype)
        assert torch.equal(out[base_rows], y[base_rows]), name  # the base's rows untouched
        touched = not torch.equal(ref_out, y)  # a slot of the step adapts the module
        assert touched == (float((out - y).float().abs().max()) > 0.1), name
        adapted += touched
    assert adapted >= 3


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_an_expand_program_may_cover_several_blocks_of_rows(monkeypatch, blocks):
    """Expand programs of 1, 2 or 3 blocks of 16 rows (the last ones part-filled, or past a
    shard's rows) give the deltas of the torch GEMMs."""
    from models.kernels import triton_lora

    monkeypatch.setattr(triton_lora, "BLOCK_N", 16)
    monkeypatch.setattr(triton_lora, "EXPAND_BLOCKS", blocks)
    test_the_kernels_add_what_the_torch_gemms_add(torch.float32, "prefill")


def test_shrink_gives_each_token_its_slots_a_rows_product_split_over_k():
    """h's parts (K split in several) sum, for each token, to x @ A.T of its slot's shard rows;
    a slot of rank 0 on a shard and the rows past its rank are left alone."""
    base = _Base(torch.float32, hidden=640)  # two loop steps of K at least
    ker, _ = _slots(base, torch.float32)
    token_slots = [3, 1, N, 2, 2, 0, 1]
    batch = ker.batch(token_slots, CPU)
    module = base.self_attn.qkv_proj
    i = ker.tables.index[id(module)]
    x = torch.randn(
        len(token_slots), module.in_features, generator=torch.Generator().manual_seed(1)
    )
    h = shrink(x, ker.tables.table[i], batch.groups, 3, ker.rank_block)
    assert h.shape[0] > 1  # K in parts
    h = h.sum(0)  # [tokens, shards, ranks]: row p is token order[p]'s
    order = [t for s in range(ker.num_slots) for t, ts in enumerate(token_slots) if ts == s]
    name = "self_attn.qkv_proj"
    for p, t in enumerate(order):
        m = ker[token_slots[t]].modules[name]
        shards = {s.name: s for s in m.shards}
        for j, shard in enumerate(("q_proj", "k_proj", "v_proj")):
            if shard in shards:
                r = shards[shard].ranks
                want = x[t] @ m.a[r].T
                assert torch.allclose(h[p, j, : r.stop - r.start], want, atol=1e-5)


def test_the_expand_adds_up_the_shrinks_parts_a_few_at_a_time():
    """A prefill's tiles of 64 tokens add up the shrink's parts 4 a load: over several loads,
    the same deltas as from the parts summed first."""
    base = _Base(torch.float32)
    ker, _ = _slots(base, torch.float32)
    token_slots = [0] * 40 + [N, 1]
    groups = ker.batch(token_slots, CPU).groups
    i = ker.tables.index[id(base.self_attn.qkv_proj)]
    shards, widest = ker.tables.shape[i]
    table, bounds = ker.tables.table[i], ker.tables.bounds[i]
    g = torch.Generator().manual_seed(7)
    h = torch.randn(7, groups.capacity, shards, ker.rank_block, generator=g)
    assert groups.block_m == 64 and parts_block(7, 64, ker.rank_block) == 4  # two loads
    y = torch.randn(len(token_slots), base.self_attn.qkv_proj.out_features, generator=g)
    got = expand(h, y.clone(), table, bounds, groups, widest)
    want = expand(h.sum(0, keepdim=True), y.clone(), table, bounds, groups, widest)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, y)


def test_the_groups_order_each_slots_tokens_and_list_their_tiles():
    values, tiles, block_m = pack_groups([2, N, 0, 2, 3, 0, 0], num_slots=5, capacity=9)
    cap = 9
    assert values[:cap] == [2, N, 0, 2, 3, 0, 0, N, N]  # the padded rows: no adapter's
    assert values[cap : cap + 6] == [2, 5, 6, 0, 3, 4]  # slot 0's, then 2's, then 3's
    # (slot, first place in the order, tokens) a tile; then none, up to the most 9 can have
    assert values[2 * cap :] == [0, 0, 3, 2, 3, 2, 3, 5, 1] + [N, 0, 0] * (5 + 0 - 3)
    assert (tiles, block_m) == (3, 16)
    # tiles of at most block_m tokens: slot 1's five tokens in two, and the most 7 can have
    values, tiles, _ = pack_groups([1, 1, 0, 1, 1, 1], num_slots=2, capacity=7, block_m=4)
    assert values[14:] == [0, 0, 1, 1, 1, 4, 1, 5, 1] + [N, 0, 0] * (2 + 1 - 3)
    assert tiles == 3 == max_tiles(7, 2, 4)
    with pytest.raises(ValueError, match="capacity"):
        pack_groups([0] * 4, num_slots=1, capacity=3)


def test_a_graph_launches_a_power_of_2_of_tiles_at_least_its_steps():
    base = _Base(torch.float32)
    ker, _ = _slots(base, torch.float32)
    graph_input = ker.graph_input(capacity=64)
    assert graph_input.tiles_for([N, N], 2) == 1  # no adapter's token: one idle tile
    assert graph_input.tiles_for([0, 0, 0], 4) == 1
    assert graph_input.tiles_for([0, 1, 2, N, 3], 8) == 4
    assert graph_input.tiles_for([0, 1, 2], 4) == 4
    assert graph_input.tiles_for([0] * 17 + [1], 32) == 4  # 17 tokens of slot 0: two tiles
    assert graph_input.tiles_for([0, 1, 2, 3, 4], 8) == 5  # 5 slots: what 8 tokens can have


def test_a_graph_input_refilled_gives_each_replays_tokens_their_slots_deltas():
    """A decode graph's LoRA work is captured once over the static buffer: refilled for each
    step (in place, its address kept), the same batch gives each step's deltas, the base's
    rows (and a step of the base alone) untouched; a slot given another adapter between two
    steps runs the new one's weights."""
    base = _Base(torch.float32)
    ker, ref = _slots(base, torch.float32)
    graph_input = ker.graph_input(capacity=8)
    batch = graph_input.batch(8, 4)  # what a graph of 8 over 4 tiles is captured over
    assert batch.touches(base.mlp) and batch.touches(base.self_attn)
    address = graph_input.buf.data_ptr()
    module = base.mlp.gate_up_proj
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, module.in_features, generator=g)
    y = torch.randn(8, module.out_features, generator=g)
    steps = [[0, 3, N, 2, 1, 3, 0, 2], [N, 2, 2], [N, N, N, N], [3, 0, N, N, 1, 1]]
    for n, token_slots in enumerate(steps):
        if n == 3:  # slot 3 now holds another adapter
            w = random_weights(base, {"gate_proj": 6, "up_proj": 3}, g)
            ker.assign(3, w)
            ref.assign(3, w)
        graph_input.fill(token_slots)
        assert graph_input.buf.data_ptr() == address
        padded = token_slots + [N] * (8 - len(token_slots))
        assert batch.token_slots.tolist() == padded
        got = batch.add(module, x, y.clone())
        want = ref.batch(padded, CPU)
        want = y.clone() if want is None else want.add(module, x, y.clone())
        _close(got, want, torch.float32)
        base_rows = [i for i, s in enumerate(padded) if s == N]
        assert torch.equal(got[base_rows], y[base_rows])


def test_slots_refuse_weights_the_kernels_cannot_read():
    base = _Base(torch.float32)
    ker, _ = _slots(base, torch.float32)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="rank 32, past the slots' 16"):
        ker.assign(4, random_weights(base, {"q_proj": 32}, g))
    with pytest.raises(ValueError, match="torch.bfloat16, want cpu in torch.float32"):
        ker.assign(4, random_weights(base, {"q_proj": 4}, g, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="needs the LoRA kernels"):
        LoraSlots(base, 2, kernels=False).graph_input(4)
    assert not LoraSlots(base, 2).kernels  # the CPU keeps the torch GEMMs by default
