"""Two Triton kernels for decode steps, where a batch-1 step is a chain of tiny launches.

- `rope_write`: rotates q and k (rope, GPT-NeoX layout, in fp32) and writes k and v to their
  cache slots: one kernel where FlashInfer's rope, then the indexed K/V store, took two or three.
  Steps of fresh prompts take it too (several heads a program for long steps), in place of
  FlashInfer's rope and append, whose inputs cost host time before the step's first kernel.
- `TritonDecodeKernel`: decode attention over the paged cache in one kernel a layer. Each
  (sequence, KV head) is split over several programs when the batch is too small to fill the
  GPU; the last program of a sequence and head to finish merges the parts (an atomic ticket
  per (sequence, KV head), left at zero for the next launch), so no second merge kernel runs.
  It reads the block table [B, W] and the lengths as the allocator keeps them: no plan.

Both run wherever Triton does: on a CUDA device, and on the host under Triton's interpreter
(TRITON_INTERPRET=1, which the CPU tests use). On the GPU the attention's products take bf16 (or
fp16) tensor cores with fp32 sums, as FlashAttention's do; the interpreter has no bf16
arithmetic, so there they are taken in fp32 (`DOT_F32`).

Cache view per layer: [num_blocks, 2, block_size, H, D], K then V, any strides.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Protocol

import torch


class LayerSpec(Protocol):
    """What the decode kernel reads of a layer's attention (models.attention.base's
    LayerAttention): its softmax scale, window (positions attended, the query's own included)
    and logit soft cap."""

    scale: float
    sliding_window: int | None
    logit_softcap: float | None


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl  # noqa: F401
    except ImportError:
        return None
    return triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the kernels here can run on `device` (CUDA with Triton; the host only under
    Triton's interpreter)."""
    if _triton() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's SMs, which the kernels here size their grids by (8 off a GPU: the
    interpreter's)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fp8_row_scale(linear: torch.nn.Module) -> torch.Tensor | None:
    """An FP8 linear's scales, one float32 a weight row ([N], contiguous), which the GEMVs and
    small GEMMs multiply into their sums (their weight loads convert E4M3 in registers); None
    for a linear of any other weight."""
    w, s = getattr(linear, "weight", None), getattr(linear, "weight_scale", None)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        return None
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != w.shape[:1]:
        return None
    return s if s.is_contiguous() else None


def _kernels():
    return _build_kernels(interpreting())


@functools.cache
def _build_kernels(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit
    def rope_write_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, table_ptr, slots_ptr, cache_ptr,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sko_t, sko_h, svo_t, svo_h, st_t,
        sc_blk, sc_kv, sc_tok, sc_h,
        HQ: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, PAGE: tl.constexpr,
        HB: tl.constexpr, KV_OUT: tl.constexpr,
    ):  # fmt: skip
        # one program per (token, HB heads): heads [0, HQ) of q, then the KV heads; HB divides
        # both head counts, so that a program's heads are all q's or all k's. KV_OUT: the
        # rotated k and v also go to ko and vo (k is left as it was), else k turns in place
        t = tl.program_id(0)
        h0 = tl.program_id(1) * HB
        hh = h0 + tl.arange(0, HB)[:, None]  # [HB, 1]
        d = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
        dm = (hh >= 0) & (d < HALF)  # [HB, HALF_P2] (hh >= 0: the column mask over every row)
        cos = tl.load(table_ptr + t * st_t + d, mask=d < HALF, other=0.0)
        sin = tl.load(table_ptr + t * st_t + HALF + d, mask=d < HALF, other=0.0)
        if h0 < HQ:
            src = q_ptr + t * sq_t + hh * sq_h + d
            dst = qo_ptr + t * so_t + hh * so_h + d
        else:
            src = k_ptr + t * sk_t + (hh - HQ) * sk_h + d
            if KV_OUT:  # noqa: SIM108 (a constexpr branch, compiled out)
                dst = ko_ptr + t * sko_t + (hh - HQ) * sko_h + d
            else:
                dst = src
        x1 = tl.load(src, mask=dm, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=dm, other=0.0).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(dst.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(dst.dtype.element_ty)
        tl.store(dst, y1, mask=dm)
        tl.store(dst + HALF, y2, mask=dm)
        if h0 >= HQ:
            hk = hh - HQ
            slot = tl.load(slots_ptr + t)
            at = cache_ptr + (slot // PAGE) * sc_blk + (slot % PAGE) * sc_tok + hk * sc_h + d
            ty = cache_ptr.dtype.element_ty
            tl.store(at, y1.to(ty), mask=dm)
            tl.store(at + HALF, y2.to(ty), mask=dm)
            vsrc = v_ptr + t * sv_t + hk * sv_h + d
            v1 = tl.load(vsrc, mask=dm, other=0.0)
            v2 = tl.load(vsrc + HALF, mask=dm, other=0.0)
            tl.store(at + sc_kv, v1.to(ty), mask=dm)
            tl.store(at + sc_kv + HALF, v2.to(ty), mask=dm)
            if KV_OUT:
                vdst = vo_ptr + t * svo_t + hk * svo_h + d
                tl.store(vdst, v1, mask=dm)
                tl.store(vdst + HALF, v2, mask=dm)

    # nsplit is a run-time value, SPLIT only whether it is above 1: two builds serve every
    # batch size (a build per value made a model's first load 7 s longer; one build for both
    # kinds, the merge's code in the unsplit kernel too, made batch 64 5% slower)
    @triton.jit(do_not_specialize=["nsplit"])
    def decode_kernel(
        q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_o_ptr, part_ml_ptr, ticket_ptr,
        k_ptr, v_ptr, table_ptr, slots_ptr,
        sq_b, sq_h, so_b, so_h, st_b, sk_b, sk_h, sv_b, sv_h, st_r,
        sc_blk, sc_kv, sc_tok, sc_h,
        scale, softcap, window, nsplit,
        HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
        MAX_SPLITS: tl.constexpr, G_P2: tl.constexpr, MERGE_D: tl.constexpr, ROPE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):  # fmt: skip
        # program (b, kv head, split s): query heads hk*G .. hk*G+G-1 of sequence b over the
        # split's share of its positions
        b = tl.program_id(0)
        hk = tl.program_id(1)
        s = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        gm = g < G
        d = tl.arange(0, D)
        hd = tl.arange(0, D // 2)
        heads = hk * G + g
        # the slots and lengths, the rope table, q in two halves (rope's), and with ROPE the
        # step's own k and v (every split loads them; the one holding the step's token stores
        # and adds them)
        if ROPE:
            slot = tl.load(slots_ptr + b)
        length = tl.load(lens_ptr + b)
        if ROPE:
            cos = tl.load(table_ptr + b * st_r + hd)
            sin = tl.load(table_ptr + b * st_r + D // 2 + hd)
        q_at = q_ptr + b * sq_b + heads[:, None] * sq_h + hd[None, :]
        q1_in = tl.load(q_at, mask=gm[:, None], other=0.0)
        q2_in = tl.load(q_at + D // 2, mask=gm[:, None], other=0.0)
        if ROPE:
            kn_at = k_ptr + b * sk_b + hk * sk_h + hd
            ka = tl.load(kn_at).to(tl.float32)
            kb = tl.load(kn_at + D // 2).to(tl.float32)
            v_in = tl.load(v_ptr + b * sv_b + hk * sv_h + d)
        lo = 0
        if WINDOW:
            lo = tl.maximum(length - window, 0)
        # each split takes a whole number of BLOCK_N tiles; `active` splits have work
        chunk = tl.cdiv(tl.cdiv(length - lo, nsplit), BLOCK_N) * BLOCK_N
        active = tl.cdiv(length - lo, chunk)
        start = lo + s * chunk
        if s < active:
            end = tl.minimum(start + chunk, length)
            # (names of their own in this branch: Triton keeps a name's type across a branch)
            q1, q2 = q1_in, q2_in
            if ROPE:  # q rotated in fp32, then rounded as the separate rope kernel stores it
                q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
                q1, q2 = (
                    q1 * cos[None, :] - q2 * sin[None, :],
                    q2 * cos[None, :] + q1 * sin[None, :],
                )
                ty = cache_ptr.dtype.element_ty
                kn1 = (ka * cos - kb * sin).to(ty)
                kn2 = (kb * cos + ka * sin).to(ty)
                vn = v_in.to(ty)
            q1 = q1.to(cache_ptr.dtype.element_ty)
            q2 = q2.to(cache_ptr.dtype.element_ty)
            if DOT_F32:
                q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            # with ROPE the step's own token is not in the cache yet: it is added after the loop
            stop = tl.minimum(end, length - 1) if ROPE else end
            for t0 in range(start, stop, BLOCK_N):
                n = t0 + tl.arange(0, BLOCK_N)
                nm = n < stop
                page = tl.load(tables_ptr + b * st_b + n // PAGE, mask=nm, other=0)
                at = page.to(tl.int64) * sc_blk + (n % PAGE) * sc_tok + hk * sc_h
                k_at = cache_ptr + at[:, None] + hd[None, :]
                k1 = tl.load(k_at, mask=nm[:, None], other=0.0)
                k2 = tl.load(k_at + D // 2, mask=nm[:, None], other=0.0)
                v = tl.load(
                    cache_ptr + sc_kv + at[:, None] + d[None, :], mask=nm[:, None], other=0.0
                )
                if DOT_F32:
                    k1, k2, v = k1.to(tl.float32), k2.to(tl.float32), v.to(tl.float32)
                x = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * scale
                if SOFTCAP:
                    x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # cap * tanh
                x = tl.where(nm[None, :], x, float("-inf"))  # [BLOCK_G, BLOCK_N]
                m_new = tl.maximum(m_i, tl.max(x, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(x - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if ROPE:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if end == length:  # the split holding the step's token: store k, v; add them
                    c_at = cache_ptr + (slot // PAGE) * sc_blk + (slot % PAGE) * sc_tok + hk * sc_h
                    tl.store(c_at + hd, kn1)
                    tl.store(c_at + D // 2 + hd, kn2)
                    tl.store(c_at + sc_kv + d, vn)
                    xn = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], 1)
                    xn += tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], 1)
                    xn = xn * scale
                    if SOFTCAP:
                        xn = softcap * (2.0 * tl.sigmoid(2.0 * xn / softcap) - 1.0)
                    m_new = tl.maximum(m_i, xn)
                    alpha = tl.exp(m_i - m_new)
                    pn = tl.exp(xn - m_new)
                    l_i = l_i * alpha + pn
                    acc = acc * alpha[:, None] + pn[:, None] * vn.to(tl.float32)[None, :]
                    m_i = m_new
            out_at = out_ptr + b * so_b + heads[:, None] * so_h + d[None, :]
            if not SPLIT:
                tl.store(
                    out_at, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None]
                )
            else:
                # this split's unnormalized output and its (max, sum) for the group's real
                # heads, then a ticket: the last split to take one merges every part
                part = (b * HKV + hk) * nsplit
                po = part_o_ptr + ((part + s) * G + g[:, None]) * D + d[None, :]
                tl.store(po, acc, mask=gm[:, None])
                pml = part_ml_ptr + ((part + s) * G + g) * 2
                tl.store(pml, m_i, mask=gm)
                tl.store(pml + 1, l_i, mask=gm)
                tl.debug_barrier()
                ticket = tl.atomic_add(ticket_ptr + b * HKV + hk, 1, sem="acq_rel")
                if ticket == active - 1:
                    # every part at once: [splits, heads] of (max, sum), then the outputs a
                    # slice of D at a time ([splits, heads, MERGE_D] in registers)
                    j = tl.arange(0, MAX_SPLITS)
                    r = tl.arange(0, G_P2)
                    jm = (j < active)[:, None] & (r < G)[None, :]
                    at = ((part + j[:, None]) * G + r[None, :]) * 2
                    m = tl.load(
                        part_ml_ptr + at, mask=jm, other=float("-inf"), cache_modifier=".cg"
                    )
                    sums = tl.load(part_ml_ptr + at + 1, mask=jm, other=0.0, cache_modifier=".cg")
                    m_all = tl.max(m, 0)  # [G_P2]
                    w = tl.where(jm, tl.exp(m - m_all[None, :]), 0.0)  # [MAX_SPLITS, G_P2]
                    total = tl.sum(w * sums, 0)
                    rows = hk * G + r
                    for d0 in tl.static_range(0, D, MERGE_D):
                        dd = d0 + tl.arange(0, MERGE_D)
                        oj = ((part + j[:, None, None]) * G + r[None, :, None]) * D + dd[
                            None, None, :
                        ]
                        parts = tl.load(
                            part_o_ptr + oj, mask=jm[:, :, None], other=0.0, cache_modifier=".cg"
                        )
                        o = tl.sum(parts * w[:, :, None], 0) / total[:, None]  # [G_P2, MERGE_D]
                        o_at = out_ptr + b * so_b + rows[:, None] * so_h + dd[None, :]
                        tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=(r < G)[:, None])
                    tl.atomic_xchg(ticket_ptr + b * HKV + hk, 0)

    return rope_write_kernel, decode_kernel


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    q_out: torch.Tensor | None = None,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (last dim contiguous, any other strides); table: this
    step's [T, D] fp32 rope table (cos of each angle, then sin); slots: [T] int64, block *
    block_size + offset -> the rotated q (in place, or into q_out), with the rotated k and v at
    their slots of cache ([num_blocks, 2, block_size, Hkv, D]) and k rotated in place, or with
    kv_out (k_out, v_out: [T, Hkv, D]) the rotated k and v there too, k left as it was."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    if q_out is None:
        q_out = q
    k_out, v_out = (k, v) if kv_out is None else kv_out
    assert dim % 2 == 0 and q.stride(2) == k.stride(2) == v.stride(2) == q_out.stride(2) == 1
    assert k_out.stride(2) == v_out.stride(2) == 1
    assert table.dtype == torch.float32 and table.stride(1) == 1 and cache.stride(4) == 1
    if t == 0:
        return q_out
    kernel = _kernels()[0]
    hb = heads_a_program(t, hq, hkv)
    kernel[(t, (hq + hkv) // hb)](
        q, k, v, q_out, k_out, v_out, table, slots, cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        v_out.stride(0), v_out.stride(1), table.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        HQ=hq, HALF=dim // 2, HALF_P2=_pow2(dim // 2), PAGE=cache.shape[2], HB=hb,
        KV_OUT=kv_out is not None,
    )  # fmt: skip
    return q_out


ROPE_WIDE_TOKENS = 128  # from this many tokens a rope_write program takes several heads
ROPE_MAX_HEADS = 8  # the most heads a program takes


def heads_a_program(tokens: int, hq: int, hkv: int) -> int:
    """The heads a rope_write program takes: one below ROPE_WIDE_TOKENS tokens (a decode step:
    as many programs as there are (token, head) pairs), else the largest power of two up to
    ROPE_MAX_HEADS that divides both head counts (a prefill: fewer, fuller programs)."""
    if tokens < ROPE_WIDE_TOKENS:
        return 1
    both = math.gcd(hq, hkv)
    hb = 1
    while hb < ROPE_MAX_HEADS and both % (2 * hb) == 0:
        hb *= 2
    return hb


MAX_SPLITS = 16  # the default most splits of a (sequence, KV head)
SPLITS_LIMIT = 64  # the most a kernel can be built for (its merge holds that many parts)
MAX_BATCH_TICKETS = 1024  # sequences a step of the kernel below may hold, times KV heads
# (warps, stages) of a decode launch of more programs than SMs (batches past one): on the H100,
# batch 16's attention took 30.8 us a layer under them against 33.5 under a batch-1 launch's
# 4 warps and 3 stages (docs/BENCHMARKS.md)
DENSE_LAUNCH = (2, 2)


class TritonDecodeKernel:
    """Decode attention for one model (its head shape and page size): called through
    `TableDecodeAttention`, and it can take the layer's rope and K/V store too (`new`). Owns
    the merge tickets, zero between launches; a model's steps run one at a time, so its layers
    share them."""

    takes_rope = True

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        device,
        max_splits: int = MAX_SPLITS,
        stages: int = 3,
        waves: int = 2,
        block_n: int | None = None,
        warps: int = 4,
        dense: tuple[int, int] | None = DENSE_LAUNCH,
    ):
        """max_splits: the most programs a (sequence, KV head) is split over; stages: Triton's
        software pipelining depth of the loop over the positions; waves: the programs a launch
        aims at, this many an SM (`splits`);
        block_n: positions a tile (a power of 2 from 16; None: 64 up to head_dim 128, else 32);
        a launch of at most one program an SM (batch 1) takes tiles twice as wide (`tile`);
        warps: a program's warps (1, 2, 4 or 8); with stages, those of a launch of at most one
        program an SM; dense: (warps, stages) of a launch of more (None: the same)."""
        if head_dim & (head_dim - 1) or head_dim < 32:
            raise ValueError(
                f"head_dim {head_dim}: the Triton decode kernel takes powers of 2 from 32"
            )
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.group = num_qo_heads // num_kv_heads
        if not 1 <= max_splits <= SPLITS_LIMIT:
            raise ValueError(f"max_splits {max_splits}: 1 to {SPLITS_LIMIT}")
        self.max_splits, self.stages = max_splits, stages
        # the parts the merge holds at once (a build each value: the default's is 16)
        self.merge_splits = _pow2(max(max_splits, 2))
        self.waves = waves
        self.block_g = max(16, _pow2(self.group))  # the dot's rows: the head group, padded
        if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
            raise ValueError(f"block_n {block_n}: a power of 2 from 16")
        self.block_n = block_n or (64 if head_dim <= 128 else 32)  # positions a tile
        if warps not in (1, 2, 4, 8):
            raise ValueError(f"warps {warps}: 1, 2, 4 or 8")
        self.warps = warps
        if dense is not None and (dense[0] not in (1, 2, 4, 8) or dense[1] < 1):
            raise ValueError(f"dense launch {dense}: (warps 1, 2, 4 or 8; stages >= 1)")
        self.dense = dense
        self.tickets = torch.zeros(
            MAX_BATCH_TICKETS * num_kv_heads, dtype=torch.int32, device=device
        )
        self.sm_count = sm_count(device)

    def splits(self, batch: int, max_len: int) -> int:
        """How many programs share each (sequence, KV head): enough for about `waves` programs
        an SM, none holding less than one tile."""
        want = -(-self.waves * self.sm_count // (batch * self.num_kv_heads))
        return max(1, min(want, self.max_splits, -(-max_len // self.block_n)))

    def tile(self, batch: int, nsplit: int) -> int:
        """The positions a tile for a launch of `batch` sequences split `nsplit` ways: twice
        block_n (at most 16384 // head_dim) when the launch is at most one program an SM, else
        block_n: each program's loop a step or two, not four (on the H100, batch 1 over 1k
        positions: 9.9 us a layer, not 11.8; at batch 16 the narrow tile leads, 33.4 us
        against 35.3)."""
        if batch * self.num_kv_heads * nsplit <= self.sm_count:
            # (up to 128 x 128 elements a tile of K: at head_dim 128, 256 positions were slower)
            return max(self.block_n, min(2 * self.block_n, 16384 // self.head_dim))
        return self.block_n

    def settings(self, batch: int, nsplit: int) -> tuple[int, int]:
        """(warps, stages) of a launch of `batch` sequences split `nsplit` ways: `dense`'s when
        it holds more programs than the GPU has SMs, else the kernel's warps and stages."""
        if self.dense is not None and batch * self.num_kv_heads * nsplit > self.sm_count:
            return self.dense
        return self.warps, self.stages

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        spec: LayerSpec,
        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [B, Hq, D]; cache: one layer's view; tables: [B, W] int32; seq_lens: [B, 1] int32
        -> [B, Hq, D]. new: the step's (k, v, rope table, slots) when q and k are not rotated
        yet and k, v not in the cache (k, v: [B, Hkv, D], table: [B, D] fp32, slots: [B]
        int64): this kernel rotates them and stores k, v (one kernel for all of it)."""
        b, hq, dim = q.shape
        assert b <= MAX_BATCH_TICKETS and q.stride(2) == 1 and cache.stride(4) == 1
        k, v, table, slots = new if new is not None else (q, q, q, seq_lens)
        assert k.stride(2) == v.stride(2) == table.stride(-1) == 1
        out = torch.empty((b, hq, dim), dtype=q.dtype, device=q.device)
        nsplit = self.splits(b, tables.shape[1] * self.block_size)
        parts = b * self.num_kv_heads * nsplit * self.group
        part_o = torch.empty(parts * dim if nsplit > 1 else 1, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(parts * 2 if nsplit > 1 else 1, dtype=torch.float32, device=q.device)
        kernel = _kernels()[1]
        warps, stages = self.settings(b, nsplit)
        kernel[(b, self.num_kv_heads, nsplit)](
            q, cache, tables, seq_lens, out, part_o, part_ml, self.tickets, k, v, table, slots,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            spec.scale, spec.logit_softcap or 0.0, spec.sliding_window or 0, nsplit,
            HKV=self.num_kv_heads, G=self.group, BLOCK_G=self.block_g, D=dim,
            PAGE=self.block_size, BLOCK_N=self.tile(b, nsplit),
            SOFTCAP=bool(spec.logit_softcap), WINDOW=bool(spec.sliding_window),
            DOT_F32=interpreting() or cache.dtype == torch.float32,
            MAX_SPLITS=self.merge_splits, G_P2=_pow2(self.group),
            MERGE_D=min(dim, max(16, 8192 // (self.merge_splits * _pow2(self.group)))),
            ROPE=new is not None, SPLIT=nsplit > 1, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    def self_check(self, specs, dtype: torch.dtype, rope: bool) -> None:
        """Builds and runs the kernel once for each kind of layer (and with the rope, when the
        steps will hand it over) on a two-block cache of zeros: at model load, so a kernel
        that cannot build or run here fails now, not in a step."""
        dev = self.tickets.device
        hkv, dim = self.num_kv_heads, self.head_dim
        cache = torch.zeros(2, 2, self.block_size, hkv, dim, dtype=dtype, device=dev)
        # block 1 (block 0 is the null block); with a table one column wide, then wide enough
        # to split: the build without the merge and the one with it; for one sequence, and
        # for enough sequences to take the narrow tile and the dense launch's settings too
        batches = (1, self.sm_count // hkv + 1)
        for b in batches:
            narrow = torch.ones(b, 1, dtype=torch.int32, device=dev)
            wide = torch.ones(b, 1 + 2 * self.block_n // self.block_size, dtype=torch.int32,
                              device=dev)  # fmt: skip
            lens = torch.full((b, 1), 2, dtype=torch.int32, device=dev)
            q = torch.zeros(b, self.group * hkv, dim, dtype=dtype, device=dev)
            new = None
            if rope:
                kv = torch.zeros(b, hkv, dim, dtype=dtype, device=dev)
                table = torch.zeros(b, dim, dtype=torch.float32, device=dev)
                new = (kv, kv, table, torch.full((b,), self.block_size + 1, device=dev))
            for spec in specs:
                for tables in (narrow, wide):
                    out = self(q, cache, tables, lens, spec, new)
                    if not torch.isfinite(out).all():
                        raise RuntimeError(f"non-finite output on zeros for {spec}")


def load_decode_kernel(
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    device: torch.device,
    specs,
    dtype: torch.dtype,
    rope: bool,
    max_splits: int = MAX_SPLITS,
    stages: int = 3,
    waves: int = 2,
    warps: int = 4,
    dense: tuple[int, int] | None = DENSE_LAUNCH,
) -> tuple[TritonDecodeKernel | None, str | None]:
    """The decode kernel for a model, built and checked on `device` (`self_check`), or None and
    why it cannot run there. heads: (query heads, KV heads)."""
    if not triton_runs_on(device):
        return None, "Triton does not run here"
    if heads[0] % heads[1]:
        return None, f"{heads[0]} query heads over {heads[1]} KV heads"
    if head_dim & (head_dim - 1) or head_dim < 32:
        return None, f"head_dim {head_dim} (a power of 2 from 32)"
    try:
        kernel = TritonDecodeKernel(
            heads[0], heads[1], head_dim, block_size, device,
            max_splits=max_splits, stages=stages, waves=waves, warps=warps, dense=dense,
        )  # fmt: skip
        kernel.self_check(specs, dtype, rope)
    except Exception as e:  # noqa: BLE001 (a kernel that does not build here: fall back)
        return None, f"its kernel failed ({type(e).__name__}: {str(e)[:200]})"
    return kernel, None
