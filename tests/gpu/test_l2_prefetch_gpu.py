"""The L2 prefetches on the GPU: the bulk prefetch instruction builds and runs (Hopper), the
decode kernel asks for ranges and gives the same output, and decode graphs that capture the
prefetches (on their side stream, or some inside the decode kernel) replay the same logits, bit
for bit, as the same graphs without them (cache hints only). And the kernels launched as
programmatic dependent launches read what the kernel before them wrote."""

from __future__ import annotations

import pytest
import torch

from models.attention import triton_ops
from models.attention.base import LayerAttention
from models.attention.flashinfer_paged import KernelChoice
from models.layers.l2_prefetch import load_prefetcher
from tests.gpu.common import GPU, cuda_pool, greedy, model_engine, on_gpu, prompts, tiny_model
from tests.gpu.test_triton_ops_gpu import BLOCK, decode_step

pytestmark = GPU


def test_the_prefetcher_builds_and_runs_over_every_point():
    cfg, cpu_model = tiny_model()
    model = on_gpu(cpu_model)
    p, why = load_prefetcher(model, torch.device("cuda"), (1 << 20, 1 << 20, 1 << 20))
    assert p is not None, why
    assert len(p.plans) == 3 * cfg.num_layers + 1  # and the final norm
    layer = model.model.layers[1]
    o, gate_up = layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight
    o_bytes = o.numel() * o.element_size()  # 512 KiB: all of it, then the head of gate_up
    assert p.plans[layer.self_attn] == [
        ((o.data_ptr(), o_bytes), (gate_up.data_ptr(), (1 << 20) - o_bytes))
    ]
    # a big weight too: 64 MiB over many programs, the stream joined, the data untouched
    big = torch.randn(32 << 20, device="cuda", dtype=torch.bfloat16)
    before = big.clone()
    p.plans[model] = [((big.data_ptr(), 64 << 20), (0, 0))]
    p.issue(model)
    p.join()
    torch.cuda.synchronize()
    assert torch.equal(big, before)


WARMED = {  # name -> (the kernels of the reference engine, the same with the prefetches)
    "side-stream": (KernelChoice(), KernelChoice(l2_prefetch_mib=(1, 1, 1))),
    "side-stream-keep": (
        KernelChoice(),
        KernelChoice(l2_prefetch_mib=(1, 1, 1), l2_prefetch_keep=True),
    ),
    # the attention window's asked by the Triton decode kernel (batches up to 16 run it)
    "inline": (KernelChoice(), KernelChoice(l2_prefetch_mib=(1, 1, 1), l2_prefetch_inline=True)),
    # every window's asked by a Triton kernel (the norms and activation too), each launched
    # while the GEMM before it finishes
    "step-ops-pdl": (
        KernelChoice(triton_step_ops=True),
        KernelChoice(
            triton_step_ops=True,
            triton_pdl=True,
            l2_prefetch_mib=(1, 1, 1),
            l2_prefetch_inline=True,
            l2_prefetch_keep=True,
        ),
    ),
}


@pytest.mark.parametrize("name", list(WARMED))
def test_graphs_with_prefetches_replay_the_same_logits(name):
    cfg, cpu_model = tiny_model(num_attention_heads=8)
    model = on_gpu(cpu_model)
    pool = cuda_pool(pages=8)
    ref, warm = WARMED[name]
    plain = model_engine("plain", cfg, model, pool, kernels=ref)
    warmed = model_engine("warmed", cfg, model, pool, kernels=warm)
    assert warmed.runner.graphs.prefetcher is not None and plain.runner.graphs.prefetcher is None
    assert warmed.runner.graphs.prefetcher.inline is warm.l2_prefetch_inline
    # one-row graphs run the GEMVs (the default) through step ops, whichever the choice
    has_ops = warm.triton_step_ops or warm.triton_gemv is not None
    assert (warmed.runner.graphs.step_ops is not None) is has_ops
    for n in (1, 3, 16):
        ps = prompts(n, seed=n)
        ref_tokens, ref_logits = greedy(plain, ps, 12)
        tokens, logits = greedy(warmed, ps, 12)
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits):
            assert torch.equal(a, b)
    for me in (plain, warmed):
        me.check_integrity()
        me.close()


def test_the_decode_kernel_asks_for_ranges_and_gives_the_same_output():
    gen = torch.Generator(device="cuda").manual_seed(3)
    md, cache = decode_step([1000, 37, 4000], 8, 128, gen)
    kernel = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, torch.device("cuda"))
    assert kernel.takes_prefetch
    q = torch.randn(3, 32, 128, device="cuda", generator=gen).bfloat16()
    spec = LayerAttention(scale=128**-0.5)
    tables, lens = md.block_tables, md.seq_lens.view(-1, 1)
    weights = torch.randn(48 << 20, device="cuda", dtype=torch.bfloat16)  # 96 MiB
    plain = kernel(q, cache, tables, lens, spec)
    keeping = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, torch.device("cuda"), l2_keep=True)
    for ranges in (
        ((weights.data_ptr(), 32 << 20), (weights.data_ptr() + (64 << 20), 16 << 20)),
        ((weights.data_ptr(), 96 << 20), (0, 0)),  # more than 16 KiB a thread
    ):
        assert torch.equal(kernel(q, cache, tables, lens, spec, prefetch=ranges), plain)
        assert torch.equal(keeping(q, cache, tables, lens, spec, prefetch=ranges), plain)
    torch.cuda.synchronize()


def test_the_step_ops_are_flashinfers_kernels():
    """Triton's add + RMSNorm and SiLU * up against FlashInfer's, at the 8B's widths, with
    PDL and an L2 prefetch riding along."""
    import flashinfer

    from models.layers import triton_step_ops

    step_ops, why = triton_step_ops.load_step_ops(torch.device("cuda"), pdl=True, prefetch=True)
    assert step_ops is not None and step_ops.pdl and step_ops.takes_prefetch, why
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randn(8 << 20, device="cuda", dtype=torch.bfloat16)
    pair = ((weights.data_ptr(), 12 << 20), (weights.data_ptr() + (12 << 20), 4 << 20))
    for rows in (1, 16):
        x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
        r = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
        w = torch.randn(4096, device="cuda", generator=g).bfloat16()
        fx, fr = x.clone(), r.clone()
        flashinfer.norm.fused_add_rmsnorm(fx, fr, w, 1e-5)
        step_ops.add_rmsnorm(x, r, w, 1e-5, pair)
        assert torch.equal(r, fr)
        torch.testing.assert_close(x, fx, rtol=2**-7, atol=1e-3)  # fp32 sums in another order
        gu = torch.randn(rows, 2 * 14336, device="cuda", generator=g).bfloat16()
        want = flashinfer.activation.silu_and_mul(gu)
        torch.testing.assert_close(step_ops.silu_mul(gu, pair), want, rtol=2**-7, atol=1e-3)


def slow_write(out: torch.Tensor, gen: torch.Generator) -> None:
    """out = a @ b, b of 256 MiB: a GEMM of about a tenth of a millisecond, the kernel right
    before the one under test, writing that kernel's input late."""
    rows, cols = out.shape
    inner = (256 << 20) // (cols * out.element_size())
    a = torch.randn(rows, inner, device="cuda", generator=gen, dtype=out.dtype)
    b = torch.randn(inner, cols, device="cuda", generator=gen, dtype=out.dtype) / inner**0.5
    torch.cuda.synchronize()  # (its inputs made before the pair under test)
    torch.mm(a, b, out=out)


def test_pdl_kernels_read_what_the_kernel_before_them_wrote():
    """A programmatic dependent launch may start while the kernel before it runs; it must read
    what that kernel writes only after its wait. Here that kernel is a slow GEMM writing the
    input last (q; the rope table; x of add + RMSNorm; gate-up of the activation), into zeros:
    each PDL kernel's output is the plain launch's, bit for bit, every time."""
    from models.layers import triton_step_ops

    hq, hkv, d, b = 32, 8, 128, 4
    md, cache = decode_step([700, 64, 1500, 3], hkv, d, torch.Generator("cuda").manual_seed(5))
    spec = LayerAttention(scale=d**-0.5)
    tables, lens = md.block_tables, md.seq_lens.view(-1, 1)
    kernels = {
        pdl: triton_ops.TritonDecodeKernel(hq, hkv, d, BLOCK, torch.device("cuda"), pdl=pdl)
        for pdl in (False, True)
    }
    assert kernels[True].pdl
    ops = {pdl: triton_step_ops.StepOps(pdl=pdl) for pdl in (False, True)}
    w = torch.randn(4096, device="cuda").bfloat16()
    for it in range(8):
        got = {}
        for pdl in (False, True):
            g = torch.Generator(device="cuda").manual_seed(it)
            rows = torch.zeros(b, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
            slow_write(rows, g)  # q, k, v: the qkv projection
            q, k, v = rows.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
            plain_q = kernels[pdl](q, cache, tables, lens, spec)
            c, table = cache.clone(), torch.zeros(b, d, device="cuda")
            slow_write(table, g)  # the step's rope table, made right before the kernel
            roped = kernels[pdl](q, c, tables, lens, spec, (k, v, table, md.slot_mapping))
            x = torch.zeros(16, 4096, device="cuda", dtype=torch.bfloat16)
            r = torch.ones(16, 4096, device="cuda", dtype=torch.bfloat16)
            slow_write(x, g)
            ops[pdl].add_rmsnorm(x, r, w, 1e-5)
            gu = torch.zeros(16, 2 * 14336, device="cuda", dtype=torch.bfloat16)
            slow_write(gu, g)
            act = ops[pdl].silu_mul(gu)
            torch.cuda.synchronize()
            got[pdl] = (plain_q, roped, c, x, r, act)
        for plain, pdl_out in zip(got[False], got[True]):
            assert torch.equal(plain, pdl_out)
    assert not kernels[True].tickets.any()


def test_a_small_grid_asks_more_than_16_kib_a_thread():
    """Batch 1 over one program a KV head: 128 threads ask 96 MiB, each past PF_CHUNK."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    md, cache = decode_step([300], 8, 128, gen)
    kernel = triton_ops.TritonDecodeKernel(32, 8, 128, BLOCK, torch.device("cuda"), max_splits=1)
    assert kernel.splits(1, md.block_tables.shape[1] * BLOCK) == 1
    assert triton_ops.prefetch_chunk(96 << 20, 8 * triton_ops.PF_BLOCK) > triton_ops.PF_CHUNK
    q = torch.randn(1, 32, 128, device="cuda", generator=gen).bfloat16()
    spec = LayerAttention(scale=128**-0.5)
    weights = torch.randn(48 << 20, device="cuda", dtype=torch.bfloat16)
    tables, lens = md.block_tables, md.seq_lens.view(-1, 1)
    plain = kernel(q, cache, tables, lens, spec)
    asked = kernel(q, cache, tables, lens, spec, prefetch=((weights.data_ptr(), 96 << 20), (0, 0)))
    assert torch.equal(asked, plain)
    torch.cuda.synchronize()
