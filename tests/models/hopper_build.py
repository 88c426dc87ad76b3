"""Builds Prism's Triton kernels for Hopper (sm_90) down to cubins, without a GPU: Triton's
wheel ships ptxas. Run in a process of its own (tests/models/test_triton_build.py): Triton's own
library is decorated for the interpreter in a process that imported it with TRITON_INTERPRET=1.

    python -m tests.models.hopper_build   # one line per build, "built N" last
"""

from __future__ import annotations

import itertools
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from models.kernels import fp8_quant, triton_gemv, triton_lora, triton_ops, triton_small_gemm

HOPPER = GPUTarget("cuda", 90, 32)
DECODE_TYPES = {
    **dict.fromkeys(("q_ptr", "cache_ptr", "out_ptr", "k_ptr", "v_ptr"), "*bf16"),
    **dict.fromkeys(("tables_ptr", "lens_ptr", "ticket_ptr"), "*i32"),
    **dict.fromkeys(("part_o_ptr", "part_ml_ptr", "table_ptr"), "*fp32"),
    "slots_ptr": "*i64",
    "scale": "fp32",
    "softcap": "fp32",
}
ROPE_TYPES = {
    **dict.fromkeys(
        ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "ko_ptr", "vo_ptr", "cache_ptr"), "*bf16"
    ),
    "table_ptr": "*fp32",
    "slots_ptr": "*i64",
}


def compile_for_hopper(fn, types: dict, const: dict, **options):
    """fn compiled for sm_90: types by parameter name (pointers, scalars; anything else i32),
    every pointer 16-byte aligned, as Triton's launcher specializes a tensor's data pointer."""
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    ptrs = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptrs}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=HOPPER, options=options)


def decode_specs():
    """The decode builds a model can ask for, as (name, constants, whether its PTX is checked,
    (warps, stages)): with and without the rope, split and not, windows and soft caps, for
    Llama-3.1-8B's head shape; with and without the rope, split and not, for Gemma 3's
    (head_dim 256, windows and soft caps) and a group of one."""
    for (hq, hkv), dim, extras in (((32, 8), 128, (True, False)), ((4, 1), 256, (True,)),
                                    ((8, 8), 64, (False,))):  # fmt: skip
        k = triton_ops.TritonDecodeKernel(hq, hkv, dim, 16, torch.device("cpu"))
        g_p2 = triton_ops._pow2(k.group)
        builds = itertools.product((True, False), (True, False), extras, extras)
        for rope, split, window, softcap in builds:
            const = dict(
                HKV=hkv, G=k.group, BLOCK_G=k.block_g, D=dim, PAGE=16, BLOCK_N=k.block_n,
                SOFTCAP=softcap, WINDOW=window, DOT_F32=False, MAX_SPLITS=triton_ops.MAX_SPLITS,
                G_P2=g_p2, MERGE_D=min(dim, max(16, 8192 // (triton_ops.MAX_SPLITS * g_p2))),
                ROPE=rope, SPLIT=split,
            )  # fmt: skip
            name = f"decode {hq}/{hkv}x{dim} {rope=} {split=} {window=} {softcap=}"
            yield name, const, True, (4, 3)
    # Llama-3.1-8B's split build with the rope for 32 splits of 32-position tiles: its merge
    # holds 32 parts (triton_max_splits past 16)
    const = {**const, "G": 4, "BLOCK_G": 16, "D": 128, "HKV": 8, "BLOCK_N": 32}
    const.update(MAX_SPLITS=32, G_P2=4, MERGE_D=64, SOFTCAP=False, WINDOW=False, ROPE=True)
    const.update(SPLIT=True)
    yield "decode 32/8x128 rope, split 32 ways, tiles of 32", const, False, (4, 3)
    # batch 1's wide tile (128 positions), split and not
    for split in (True, False):
        wide = {**const, "BLOCK_N": 128, "MAX_SPLITS": triton_ops.MAX_SPLITS, "MERGE_D": 128}
        name = f"decode 32/8x128 rope, tiles of 128, {split=}"
        yield name, {**wide, "SPLIT": split}, False, (4, 3)
    # the split build of 64-position tiles in 8 warps (the decode kernel's `warps`), and in a
    # dense launch's warps and stages (batches past one)
    narrow = {**const, "BLOCK_N": 64, "MAX_SPLITS": 16, "MERGE_D": 128}
    yield "decode 32/8x128 rope, split, 8 warps", narrow, False, (8, 3)
    yield "decode 32/8x128 rope, split, a dense launch", narrow, False, triton_ops.DENSE_LAUNCH


def decode_builds(share: int = 0, shares: int = 1):
    """The builds of `decode_specs` whose index is `share` modulo `shares`, compiled, their PTX
    checked: (name, build)."""
    decode = triton_ops._build_kernels(False)[1]
    for i, (name, const, check, (warps, stages)) in enumerate(decode_specs()):
        if i % shares != share:
            continue
        b = compile_for_hopper(decode, DECODE_TYPES, const, num_warps=warps, num_stages=stages)
        if check:
            # a plain launch: it neither waits for the kernel before it nor asks the L2 ahead
            ptx = b.asm["ptx"]
            assert "griddepcontrol" not in ptx and "cp.async.bulk.prefetch" not in ptx, name
        yield name, b


GEMV_TYPES = {
    **dict.fromkeys(("w_ptr", "x_ptr", "h_ptr", "nw_ptr", "b_ptr", "out_ptr"), "*bf16"),
    "s_ptr": "*fp32",
    "eps": "fp32",
}
FP8 = {"w_ptr": "*fp8e4nv"}  # an FP8 linear's weight (its row scales: s_ptr)


def gemv_builds():
    """A one-row layer's GEMVs (triton_gemv) for Llama-3.1-8B's shapes; one with a bias, of
    Qwen2's qkv; and gate_up making SiLU * up (GLU); each in bf16 and over FP8 weights with
    their row scales; qkv and gate_up again with the norm read in one pass (`one_pass`)."""
    fn = triton_gemv._build(False)
    c = triton_gemv.GemvConfig()
    pro_norm, pro_silu = triton_gemv.PRO_NORM, triton_gemv.PRO_SILU
    shapes = (  # name, K, PRO, INTO, HAS_H, BIAS
        ("qkv", 4096, pro_norm, False, True, False),
        ("o", 4096, 0, True, True, False),
        ("gate_up", 4096, pro_norm, False, False, False),
        ("down", 14336, pro_silu, False, False, False),
        ("qkv+bias", 3584, pro_norm, False, True, True),
        ("gate_up+glu", 4096, pro_norm, False, False, False),
        ("qkv one pass", 4096, pro_norm, False, True, False),
        ("gate_up+glu one pass", 4096, pro_norm, False, False, False),
    )
    kinds = ((False, 0), (True, 0), (True, 8))  # (FP8, WVEC): bf16, E4M3 loads of 16 and 8
    for (name, k, pro, into, has_h, bias), (fp8, wvec) in itertools.product(shapes, kinds):
        glu = "glu" in name
        const = dict(K=k, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PRO=pro, INTO=into, HAS_H=has_h,
                     BIAS=bias, UNROLL=c.unroll, GLU=glu, SCALE=fp8,
                     ONE_PASS=name.endswith("one pass"), WVEC=wvec)  # fmt: skip
        types = {**GEMV_TYPES, **FP8} if fp8 else GEMV_TYPES
        b = compile_for_hopper(fn, types, const, num_warps=c.warps, num_stages=1)
        ptx = b.asm["ptx"]
        assert "griddepcontrol" not in ptx and "cp.async.bulk.prefetch" not in ptx, name
        # W read 16 bytes a load (8 with WVEC 8), the first lines the L2 evicts
        width = "v2" if wvec == 8 else "v4"
        assert re.search(rf"ld\.global\.L1::evict_first\.L2::cache_hint\.{width}", ptx), name
        assert "createpolicy.fractional.L2::evict_first" in ptx, name
        if fp8:  # E4M3 widened in registers (cvt), never a bf16 copy of W in memory
            assert "e4m3" in ptx, name
        yield f"gemv {name}" + (f" fp8 (loads of {wvec or 16})" if fp8 else ""), b


SMALL_GEMM_TYPES = {
    **dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "out_ptr", "nw_ptr", "xs_ptr"), "*bf16"),
    **dict.fromkeys(("sq_ptr", "sq_out_ptr", "s_ptr"), "*fp32"),
    "eps": "fp32",
}


def small_gemm_builds():
    """A few-row step's projections (triton_small_gemm) for Llama-3.1-8B's shapes, and Qwen2's
    qkv with its bias, under the default tiling, plain and as a small layer's (after a norm,
    into the residual stream with the next norm's input out, gate_up making SiLU * up under
    the wide tiling); the first layer's prenorm: products on the tensor cores, W's tiles
    fetched asynchronously into shared memory (the loop pipelined)."""
    fn, prenorm = triton_small_gemm._build(False)
    default = triton_small_gemm.SmallGemmConfig()
    builds = (  # name, K, outputs, BIAS, PRE, INTO, NEXT, GLU
        ("qkv", 4096, 6144, False, False, False, False, False),
        ("down", 14336, 4096, False, False, False, False, False),
        ("qkv+bias", 3584, 4608, True, False, False, False, False),
        ("qkv after the norm", 4096, 6144, False, True, False, False, False),
        ("o into the stream, the next norm's input out", 4096, 4096, False, False, True, True,
         False),
        ("gate_up making SiLU * up after the norm", 4096, 28672, False, True, False, False, True),
        ("down into the stream", 14336, 4096, False, False, True, False, False),
        ("qkv+bias after the norm", 3584, 4608, True, True, False, False, False),
    )  # fmt: skip
    fp8_builds = {"qkv", "down", "gate_up making SiLU * up after the norm"}
    for name, k, n, bias, pre, into, nxt, glu in builds:
        for fp8 in (False, True) if name in fp8_builds else (False,):
            c = default.for_outputs(n)
            const = dict(K=k, BLOCK_M=triton_small_gemm.MAX_ROWS, BLOCK_N=c.block_n,
                         BLOCK_K=c.block_k, EVEN_K=k % c.block_k == 0, BIAS=bias, DOT_F32=False,
                         PRE=pre, INTO=into, NEXT=nxt, GLU=glu, SCALE=fp8,
                         PARTS_BLOCK=triton_small_gemm.PARTS_BLOCK)  # fmt: skip
            types = {**SMALL_GEMM_TYPES, **FP8} if fp8 else SMALL_GEMM_TYPES
            b = compile_for_hopper(fn, types, const, num_warps=c.warps, num_stages=c.stages)
            ptx = b.asm["ptx"]
            assert re.search(r"\bw?mma\b|mma\.sync|wgmma\.mma_async", ptx), name
            # W's tiles asynchronous copies, in the loop as before it
            copies = b.asm["ttgir"].count("async_copy_global_to_local")
            assert copies == c.stages, (name, copies)
            yield f"small gemm {name}" + (" fp8" if fp8 else ""), b
    const = dict(BLOCK_M=triton_small_gemm.MAX_ROWS, BLOCK_N=triton_small_gemm.PRENORM_BLOCK)
    yield "prenorm", compile_for_hopper(prenorm, SMALL_GEMM_TYPES, const, num_warps=4)


LORA_TYPES = {
    **dict.fromkeys(("x_ptr", "y_ptr"), "*bf16"),
    "table_ptr": "*i64",
    **dict.fromkeys(("groups_ptr", "bounds_ptr"), "*i32"),
    "h_ptr": "*fp32",
}


def lora_builds():
    """The LoRA shrink and expand (triton_lora) of Llama-3.1-8B's qkv (three shards) and down
    (one), for a decode step's one-token tiles and a prefill's tiles of 64, ranks to 16 and 64:
    products on the tensor cores, each slot's weights read through the table's addresses."""
    shrink, expand = triton_lora._build(False)
    for (name, k, shards), block_m, rank in itertools.product(
        (("qkv", 4096, 3), ("down", 14336, 1)), (16, 64), (16, 64)
    ):
        const = dict(K=k, J=shards, R=rank, BLOCK_M=block_m,
                     BLOCK_K=triton_lora.BLOCK_K, DOT_F32=False)  # fmt: skip
        b = compile_for_hopper(shrink, LORA_TYPES, const, num_warps=4)
        assert re.search(r"\bw?mma\b|mma\.sync|wgmma\.mma_async", b.asm["ptx"]), name
        yield f"lora shrink {name} tiles of {block_m} rank {rank}", b
        const = dict(J=shards, R=rank, BLOCK_M=block_m, BLOCK_N=triton_lora.BLOCK_N,
                     NB=triton_lora.EXPAND_BLOCKS, PB=triton_lora.parts_block(16, block_m, rank),
                     DOT_F32=False)  # fmt: skip
        b = compile_for_hopper(expand, LORA_TYPES, const, num_warps=4)
        assert re.search(r"\bw?mma\b|mma\.sync|wgmma\.mma_async", b.asm["ptx"]), name
        yield f"lora expand {name} tiles of {block_m} rank {rank}", b


QUANT_TYPES = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}


def quant_builds():
    """The per-token FP8 quantizer (fp8_quant) of Llama-3.1-8B's projection inputs (4096 and
    14336 columns, each row in one block) and of a row wider than a block: the quotients
    correctly rounded, cast to E4M3 to nearest, saturating."""
    fn = fp8_quant._build(False)
    for k in (4096, 14336, 28672):
        block, warps = fp8_quant.launch_shape(k)
        const = dict(K=k, BLOCK_K=block, MIN_AMAX=fp8_quant.MIN_AMAX,
                     FP8_MAX=fp8_quant.FP8_MAX, OUT_F32=False)  # fmt: skip
        b = compile_for_hopper(fn, QUANT_TYPES, const, num_warps=warps)
        ptx = b.asm["ptx"]
        assert "div.rn.f32" in ptx and re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), k
        yield f"fp8 quantizer K={k}", b


def build_decode(share: int = 0, shares: int = 1) -> int:
    """The decode kernel's builds (those of `share` modulo `shares`); how many."""
    built = 0
    for name, b in decode_builds(share, shares):
        assert b.asm["cubin"], name
        print(name)
        built += 1
    return built


def build_others() -> int:
    """Every other kernel's builds: the rope and K/V write, the GEMVs, the small GEMMs (bf16 and
    FP8), the LoRA shrink and expand, the FP8 quantizer; how many."""
    built = 0
    rope_write = triton_ops._build_kernels(False)[0]
    # a decode's, a prefill's; k and v also out (a piecewise graph's static buffers) or not
    for half, heads, kv_out in itertools.product((64, 128), (1, 8), (False, True)):
        const = dict(HQ=32, HALF=half, HALF_P2=half, PAGE=16, HB=heads, KV_OUT=kv_out)
        assert compile_for_hopper(rope_write, ROPE_TYPES, const).asm["cubin"]
        print(f"rope_write half={half} heads={heads} kv_out={kv_out}")
        built += 1
    for name, b in gemv_builds():
        assert b.asm["cubin"], name
        print(name)
        built += 1
    for name, b in itertools.chain(small_gemm_builds(), lora_builds(), quant_builds()):
        assert b.asm["cubin"], name
        print(name)
        built += 1
    return built


def main() -> None:
    """python -m tests.models.hopper_build [decode[:I/N]|others]: those builds (the decode
    kernel's I-th share of N; nothing named: every build), then `built N`."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "a build for the GPU, not the interpreter"
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    built = 0
    if part == "all" or part.startswith("decode"):
        share, shares = (int(x) for x in (part.partition(":")[2] or "0/1").split("/"))
        built += build_decode(share, shares)
    if part in ("all", "others"):
        built += build_others()
    print(f"built {built}")


if __name__ == "__main__":
    main()
