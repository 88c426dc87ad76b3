"""A step's LoRA deltas as two Triton kernels a module, whatever its mix of adapters and tokens.

For a module with shards j (q/k/v of qkv_proj, gate/up of gate_up_proj, or one), each token t of
adapter slot s gets y[t, rows_j] += (x[t] @ A_s[offs_j : offs_j + r_sj].T) @ B_sj.T, where A_s
stacks the shards' A's ([sum of ranks, K]) and B_sj is [rows_j, r_sj] (scaling folded in):

- `shrink`: h[p, j, :r_sj] = x[t] @ A_s[offs_j ...].T, fp32 sums, split over K in `splits`
  parts (partial sums [splits, T, J, R], added by the expand, so no atomics: the same result
  every run);
- `expand`: y[t, rows_j] += round(round(sum of h's parts) @ B_sj.T), rounded where the per-slot
  torch GEMMs (models.lora.batch) round.

Both are driven by the step's tokens grouped by slot on the device (`TokenGroups`): a program
takes one tile of up to block_m tokens of one slot (Punica's SGMV and BGMV in one form: a
prefill's segment fills tiles, a decode step's one token of a slot is a tile of one row),
gathering their rows of x and scattering into y by index, so tokens of a slot need not be
contiguous and slots come in any order; tokens of no adapter (-1) are in no tile. The tiles are
listed densely, so a launch covers just the step's tiles; a decode graph covers a power of 2 of
them at least (the runner keeps a graph for each), so few of its programs find no tile, and
those, and programs of a shard the tile's adapter leaves alone (rank 0) or past a shard's rows,
return at once: a launch's grid depends only on its sizes, so a CUDA graph replays it over
whatever tiles the static buffers hold.

The weights are read where they lie: each module's table row of a slot holds A_s's address and
each shard's B's address, rank and first row of A (models.lora.tables), so assigning a slot
writes a row of addresses and copies no weights. Ranks are masked up to rank_block (a power of
2 >= 16, the base's largest rank rounded up).

Runs under Triton's interpreter too (the CPU tests), its products in fp32 there. The tilings
are the H100's best of those tried (docs/BENCHMARKS.md: `bench_kernels.py lora`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.kernels.triton_ops import _pow2, interpreting, sm_count

NO_SLOT = -1
# the H100's best of those tried for a decode step of 32 tokens (bench_kernels.py lora): 256
# rows an expand program (128: 1583 / 2047 / 4970 us a step at 1 / 8 / 32 adapters, 256: 1534
# / 1822 / 3829), 256 columns a shrink step (128: 2469 -> 2252 us at one adapter); K in up to
# 16 parts (at most 4: 1619 -> 2420 us at one adapter, but 5000 -> 3873 at 32)
BLOCK_N = 256  # expand: output rows a block
EXPAND_BLOCKS = 1  # expand: blocks of BLOCK_N rows a program (its tile's sums loaded once)
BLOCK_K = 256  # shrink: columns of x a loop step
MAX_SPLITS = 16  # shrink: most parts of K
DECODE_BLOCK_M = 16  # a decode graph's tiles (tl.dot's least)


@dataclass(frozen=True)
class TokenGroups:
    """A step's tokens grouped by adapter slot, on the device: `buf` int32 [2 C + 3 M] holds

    - token_slots [C]: each token's slot (-1: none, and every row past the step's tokens),
    - order [C]: the indices of the tokens with a slot, by slot, ascending within one,
    - tiles [M, 3]: each tile's slot, its first place in `order` and its tokens (at most
      block_m, of that slot), by slot; then (-1, 0, 0),

    C the capacity (the step's tokens, or a graph's largest batch), M = max_tiles(C, S,
    block_m), S the slot count. A launch covers the first `tiles` tiles."""

    buf: torch.Tensor
    capacity: int
    num_slots: int
    block_m: int
    tiles: int

    @property
    def token_slots(self) -> torch.Tensor:
        return self.buf[: self.capacity]


def max_tiles(capacity: int, num_slots: int, block_m: int) -> int:
    """The most tiles of `capacity` tokens over `num_slots` slots: a part-filled tile a slot
    with tokens at most, the rest full."""
    return min(num_slots, capacity) + capacity // block_m


def pack_groups(
    token_slots: Sequence[int], num_slots: int, capacity: int, block_m: int | None = None
) -> tuple[list, int, int]:
    """TokenGroups' buffer on the host for `token_slots` (at most `capacity` of them, each in
    [0, num_slots) or -1) in tiles of block_m tokens (None: `block_m_for` the most tokens of
    a slot); -> (its values, its tiles, block_m)."""
    if len(token_slots) > capacity:
        raise ValueError(f"{len(token_slots)} tokens past the capacity {capacity}")
    by_slot: list[list[int]] = [[] for _ in range(num_slots)]
    for i, s in enumerate(token_slots):
        if s != NO_SLOT:
            by_slot[s].append(i)
    if block_m is None:
        block_m = block_m_for(max(map(len, by_slot), default=0))
    order: list[int] = []
    tiles: list[int] = []
    for s, idx in enumerate(by_slot):
        for i in range(0, len(idx), block_m):
            tiles += [s, len(order) + i, min(block_m, len(idx) - i)]
        order += idx
    most = max_tiles(capacity, num_slots, block_m)
    values = list(token_slots) + [NO_SLOT] * (capacity - len(token_slots))
    values += order + [0] * (capacity - len(order))
    values += tiles + [NO_SLOT, 0, 0] * (most - len(tiles) // 3)
    return values, len(tiles) // 3, block_m


def block_m_for(tokens: int) -> int:
    """The tile of tokens for a slot of at most `tokens` (16 .. 64: tl.dot's least, and a
    prefill's segment's tile)."""
    return min(64, max(16, _pow2(tokens)))


def parts_block(parts: int, block_m: int, rank_block: int) -> int:
    """The shrink's parts an expand program adds up a load: all of them (up to 16) for a
    decode step's tiles of rank 16, fewer for larger tiles (at most 4096 values a load)."""
    return max(1, min(_pow2(parts), 4096 // (block_m * rank_block)))


def _splits(k: int, tiles: int, shards: int, device: torch.device) -> int:
    """The parts of K for a shrink of `tiles` token tiles at least: about two programs an SM,
    each part at least a loop step."""
    want = -(-2 * sm_count(device) // (tiles * shards))
    return max(1, min(MAX_SPLITS, k // BLOCK_K, want))


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    # (the sizes that vary from step to step are plain arguments, not specialized on: a new
    # prompt length compiles nothing)
    @triton.jit(do_not_specialize=["cap", "sx", "st", "k_part"])
    def shrink_kernel(
        x_ptr, table_ptr, groups_ptr, h_ptr, cap, sx, st, k_part,
        K: tl.constexpr, J: tl.constexpr, R: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # program (tile i, shard j, part q): h[q, p, j, :] for the tokens p of tile i, over
        # columns [q * k_part, (q + 1) * k_part) of K
        tile = groups_ptr + 2 * cap + 3 * tl.program_id(0)
        j = tl.program_id(1)
        q = tl.program_id(2)
        slot = tl.load(tile)
        if slot >= 0:
            start = tl.load(tile + 1)
            count = tl.load(tile + 2)
            rank = tl.load(table_ptr + slot * st + 2 + 3 * j).to(tl.int32)
            if rank > 0:
                dt = x_ptr.dtype.element_ty
                a_ptr = tl.load(table_ptr + slot * st).to(tl.pointer_type(dt))
                off = tl.load(table_ptr + slot * st + 3 + 3 * j).to(tl.int32)
                pi = tl.arange(0, BLOCK_M)
                pm = pi < count
                tok = tl.load(groups_ptr + cap + start + pi, mask=pm, other=0).to(tl.int64)
                r = tl.arange(0, R)
                rm = r < rank
                acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
                k_lo = q * k_part
                for k0 in range(0, k_part, BLOCK_K):
                    kk = k_lo + k0 + tl.arange(0, BLOCK_K)
                    km = kk < K
                    xt = tl.load(
                        x_ptr + tok[:, None] * sx + kk[None, :],
                        mask=pm[:, None] & km[None, :],
                        other=0.0,
                    )  # [BLOCK_M, BLOCK_K]
                    at = tl.load(
                        a_ptr + (off + r)[None, :].to(tl.int64) * K + kk[:, None],
                        mask=rm[None, :] & km[:, None],
                        other=0.0,
                    )  # [BLOCK_K, R]: A's rows of the shard, transposed
                    if DOT_F32:  # the interpreter (no bf16 arithmetic), or fp32 weights
                        acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc,
                                     input_precision="ieee")  # fmt: skip
                    else:
                        acc = tl.dot(xt, at, acc)
                pos = start + pi  # the tokens' places in `order`: h's rows
                h_at = h_ptr + ((q * cap + pos[:, None]) * J + j) * R + r[None, :]
                tl.store(h_at, acc, mask=pm[:, None] & rm[None, :])

    @triton.jit(do_not_specialize=["cap", "sy", "st", "parts"])
    def expand_kernel(
        h_ptr, y_ptr, table_ptr, bounds_ptr, groups_ptr, cap, sy, st, parts,
        J: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        NB: tl.constexpr, PB: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # program (tile i, shard j, n): y[t, row0_j + (n * NB + b) * BLOCK_N + i] of the tokens
        # t of tile i, for its NB blocks b. Each (token, row) is one program's: a token is in
        # one tile, once
        tile = groups_ptr + 2 * cap + 3 * tl.program_id(0)
        j = tl.program_id(1)
        n = tl.program_id(2)
        slot = tl.load(tile)
        if slot >= 0:
            start = tl.load(tile + 1)
            count = tl.load(tile + 2)
            rank = tl.load(table_ptr + slot * st + 2 + 3 * j).to(tl.int32)
            row0 = tl.load(bounds_ptr + j)
            rows = tl.load(bounds_ptr + j + 1) - row0
            if (rank > 0) & (n * NB * BLOCK_N < rows):
                dt = y_ptr.dtype.element_ty
                b_ptr = tl.load(table_ptr + slot * st + 1 + 3 * j).to(tl.pointer_type(dt))
                pi = tl.arange(0, BLOCK_M)
                pm = pi < count
                tok = tl.load(groups_ptr + cap + start + pi, mask=pm, other=0).to(tl.int64)
                r = tl.arange(0, R)
                rm = r < rank
                hm = pm[:, None] & rm[None, :]
                h_at = h_ptr + (((start + pi)[:, None]) * J + j) * R + r[None, :]
                # the parts PB at a time: one load each (not a chain of loads a part)
                pp = tl.arange(0, PB)
                h = tl.zeros([BLOCK_M, R], dtype=tl.float32)
                for q0 in range(0, parts, PB):
                    qq = q0 + pp
                    part = tl.load(
                        h_at[None, :, :] + qq[:, None, None].to(tl.int64) * (cap * J * R),
                        mask=(qq < parts)[:, None, None] & hm[None, :, :],
                        other=0.0,
                    )  # [PB, BLOCK_M, R]
                    h += tl.sum(part, 0)
                h = h.to(dt)  # rounded as the shrink's GEMM rounds its output
                for b in range(NB):
                    i = (n * NB + b) * BLOCK_N + tl.arange(0, BLOCK_N)
                    im = i < rows
                    bt = tl.load(
                        b_ptr + i[None, :].to(tl.int64) * rank + r[:, None],
                        mask=rm[:, None] & im[None, :],
                        other=0.0,
                    )  # [R, BLOCK_N]: B's rows, transposed
                    if DOT_F32:
                        d = tl.dot(h.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
                    else:
                        d = tl.dot(h, bt)
                    ym = pm[:, None] & im[None, :]
                    y_at = y_ptr + tok[:, None] * sy + (row0 + i)[None, :]
                    yv = tl.load(y_at, mask=ym, other=0.0)
                    out = yv.to(tl.float32) + d.to(dt).to(tl.float32)  # rounded as torch's add_
                    tl.store(y_at, out.to(dt), mask=ym)

    return shrink_kernel, expand_kernel


def shrink(
    x: torch.Tensor, table: torch.Tensor, groups: TokenGroups, shards: int, rank_block: int
) -> torch.Tensor:
    """The shrink of one module: x [T, K] (T <= groups.capacity, rows unit-strided); table
    [S, 1 + 3 shards] int64 (models.lora.tables); -> the partial sums [parts, capacity, shards,
    rank_block] fp32 (row p: token order[p]; columns past a slot's rank, and rows of no
    token, unwritten)."""
    t, k = x.shape
    assert x.stride(1) == 1 and table.stride(1) == 1 and table.shape[0] == groups.num_slots
    assert t <= groups.capacity and rank_block >= 16 and rank_block & (rank_block - 1) == 0
    tiles = -(-t // groups.block_m)
    parts = _splits(k, tiles, shards, x.device)
    per_part = -(-k // parts)
    k_part = -(-per_part // BLOCK_K) * BLOCK_K  # whole loop steps
    h = torch.empty(
        parts, groups.capacity, shards, rank_block, dtype=torch.float32, device=x.device
    )
    kernel, _ = _build(interpreting())
    kernel[(groups.tiles, shards, parts)](
        x, table, groups.buf, h, groups.capacity, x.stride(0), table.stride(0), k_part,
        K=k, J=shards, R=rank_block, BLOCK_M=groups.block_m, BLOCK_K=BLOCK_K,
        DOT_F32=interpreting() or x.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return h


def expand(
    h: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    bounds: torch.Tensor,
    groups: TokenGroups,
    widest: int,
) -> torch.Tensor:
    """y [T, out] (rows unit-strided) += the expand of shrink's partial sums h, in place: shard
    j's outputs are y's columns bounds[j] .. bounds[j + 1] (bounds: int32 [shards + 1] on the
    device; widest: the most columns of a shard)."""
    parts, cap, shards, rank_block = h.shape
    assert cap == groups.capacity and y.stride(1) == 1 and bounds.numel() >= shards + 1
    _, kernel = _build(interpreting())
    blocks = -(-widest // BLOCK_N)
    nb = min(EXPAND_BLOCKS, blocks)
    kernel[(groups.tiles, shards, -(-blocks // nb))](
        h, y, table, bounds, groups.buf, cap, y.stride(0), table.stride(0), parts,
        J=shards, R=rank_block, BLOCK_M=groups.block_m, BLOCK_N=BLOCK_N, NB=nb,
        PB=parts_block(parts, groups.block_m, rank_block),
        DOT_F32=interpreting() or y.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return y
