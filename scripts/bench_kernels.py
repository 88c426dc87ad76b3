"""The kernel benchmark: Prism's kernels alone against the library kernels they replace and the
HBM floor, Llama-3.1-8B's shapes, bf16, one GPU, in the same run; and FlashInfer's modules
compiled ahead on a machine without a GPU. One command a part:

    python3 scripts/bench_kernels.py gemv [--configs "8:512:4:2 16:256:4:4"]    # batch 1
    python3 scripts/bench_kernels.py smallgemm [--rows "16 8 4"] [--configs ...] # a few rows
    python3 scripts/bench_kernels.py attn [--batches "1 16"] [--configs ...]     # decode attention
    python3 scripts/bench_kernels.py lora [--distinct "1 8 32"] [--batch 32]     # LoRA deltas
    python3 scripts/bench_kernels.py prebuild [SHAPE ...]                        # no GPU needed

Each part's --help says what it measures. The tiling that leads is what a kernel table entry
(docs/CONFIG.md) takes: `gemv`, `small_gemm`, `triton_*`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def hbm_gbs(dev) -> float:
    """The bus's rate (GB/s, read + write) by a 1 GiB copy, best of 5."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return 2 * a.numel() / best / 1e6


def gpu_start(dev) -> dict:
    """A GPU benchmark's start: torch seeded, the copy rate measured and printed with the
    device's name; both, for the benchmark's JSON."""
    torch.manual_seed(0)
    gbs = hbm_gbs(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"HBM {gbs:.0f} GB/s (1 GiB copy); {name}")
    return {"hbm_gbs": gbs, "device": name}


from models.attention.base import LayerAttention  # noqa: E402
from models.kernels import triton_gemv  # noqa: E402
from models.kernels.triton_gemv import GemvConfig, gemv  # noqa: E402
from models.kernels.triton_ops import TritonDecodeKernel  # noqa: E402
from models.kernels.triton_small_gemm import SmallGemmConfig, prenorm, small_gemm  # noqa: E402
from models.layers.fp8_linear import Fp8Linear, scaled_mm_runs  # noqa: E402
from models.quantization import quantize_fp8  # noqa: E402

# --- gemv --------------------------------------------------------------------------------------

HIDDEN, INTER, QKV = 4096, 14336, 6144
SHAPES = {  # name -> (out, in), the prologue/epilogue the chain gives it
    "qkv_proj": (QKV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
}
GEMV_CONFIGS = (
    "8:512:4:1 8:512:4:2 8:512:4:4 16:512:4:2 4:1024:4:2 8:1024:8:2 2:2048:4:2 4:2048:8:1 "
    "16:256:4:4 32:256:8:2"
)


def graph_ms(fn, runs: int) -> float:
    """fn (a chain of launches) captured in one CUDA graph; the replay's median ms."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # builds every kernel before the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(runs + 3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times[3:])


def linears(n: int, k: int, count: int, dev, fp8: bool = False) -> list[torch.nn.Module]:
    """`count` projections of n x k, bf16; fp8: their FP8 forms (E4M3, a scale a row), whose
    forward is torch._scaled_mm's (the cuBLAS reference of an FP8 model's projections)."""
    out = []
    for _ in range(count):
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        torch.nn.init.normal_(lin.weight, std=k**-0.5)
        if fp8:
            q = Fp8Linear.like(lin).to(dev)
            q.weight.data, q.weight_scale.data = quantize_fp8(lin.weight.data)
            q.scaled_mm_min_rows = 1 if scaled_mm_runs(dev) else None
            lin = q
        out.append(lin)
    return out


def close(got: torch.Tensor, want: torch.Tensor, fp8: bool) -> None:
    """A kernel's output against cuBLAS's; an FP8 reference (_scaled_mm) rounds x to E4M3 too
    (2**-4 of each value at most), so the two are compared by their difference's norm."""
    if not fp8:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        return
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 5e-2, f"{rel:.3g} off _scaled_mm's product"


def weight_size(fp8: bool) -> int:
    """Bytes a weight element."""
    return 1 if fp8 else 2


@torch.no_grad()
def main_gemv() -> None:
    """Batch-1 projections: cuBLAS against Prism's Triton GEMVs that carry the ops between them.

    Llama-3.1-8B's shapes, bf16, on one GPU, in the same run:
    1. each projection alone, the weight cold (a CUDA graph of `--layers` projections, each of its
       own copy of the weight, so that none is in the L2): cuBLAS (torch's linear) and the GEMV
       under each tiling of `--configs`, against the HBM floor (the bytes over a copy's rate);
    2. a layer's chain without its attention, `--layers` deep in one graph: cuBLAS with FlashInfer's
       add + RMSNorm and SiLU * up between the GEMMs (the engine's default at batch 1), against the
       four GEMVs that carry them (triton_gemv), under
       the tiling that led in 1 for each projection, and under the one that led over all four (the
       kernel table's `gemv` entry takes one; printed last). The chain's floor is its
       weights' bytes over the copy rate.

        python3 scripts/bench_kernels.py gemv [--configs "8:512:4:2 16:256:4:4"] [--json out.json]
    """
    ap = argparse.ArgumentParser(description=main_gemv.__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=GEMV_CONFIGS, help="GEMV tilings BN:BK:WARPS:UNROLL")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (cuBLAS: torch._scaled_mm)")
    ap.add_argument("--chain-configs", default="", help="tilings to run the whole chain under")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "alone": [], "fp8": args.fp8}
    gbs, wsize = out["hbm_gbs"], weight_size(args.fp8)
    configs = [GemvConfig.parse(c) for c in args.configs.split()]
    layers = {name: linears(n, k, args.layers, dev, args.fp8) for name, (n, k) in SHAPES.items()}
    best: dict[str, GemvConfig] = {}
    # 1. each projection alone, cold
    for name, (n, k) in SHAPES.items():
        lins = layers[name]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        floor = n * k * wsize / gbs / 1e6 * 1e3  # us
        cublas = graph_ms(lambda lins=lins, x=x: [lin(x) for lin in lins], args.runs)
        cublas = cublas / len(lins) * 1e3
        row = {"gemm": name, "floor_us": floor, "cublas_us": cublas, "gemv_us": {}}
        for c in configs:
            close(gemv(lins[0], x, config=c), lins[0](x), args.fp8)
            us = graph_ms(lambda c=c, ls=lins, x=x: [gemv(w, x, config=c) for w in ls], args.runs)
            row["gemv_us"][str(c)] = us / len(lins) * 1e3
        lead = min(configs, key=lambda c: row["gemv_us"][str(c)])
        best[name] = lead
        out["alone"].append(row)
        print(
            f"{name} ({n}x{k}): floor {floor:.1f} us, cuBLAS {cublas:.1f} us, GEMV "
            + ", ".join(f"{c} {v:.1f}" for c, v in zip(configs, row["gemv_us"].values()))
            + f" us; best {row['gemv_us'][str(lead)]:.1f} us"
        )
    # 2. the layer chain without attention, `--layers` deep
    import flashinfer

    ln1, ln2 = (torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2))
    eps = 1e-5
    residual0 = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    attn_out = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    residual = residual0.clone()
    L = args.layers

    def unfused():
        r, x = residual.copy_(residual0), h0.clone()
        for i in range(L):
            flashinfer.norm.fused_add_rmsnorm(x, r, ln1, eps)
            layers["qkv_proj"][i](x)
            a = layers["o_proj"][i](attn_out)
            flashinfer.norm.fused_add_rmsnorm(a, r, ln2, eps)
            gu = layers["gate_up_proj"][i](a)
            x = layers["down_proj"][i](flashinfer.activation.silu_and_mul(gu))
        return x, r

    def fused(tiling: dict[str, GemvConfig], glu: bool = False):
        """glu: SiLU * up made by gate_up's GEMV, the down GEMV a plain one."""

        def chain():
            r, x = residual.copy_(residual0), h0.clone()

            def proj(name: str, i: int, x, **ops):
                return gemv(layers[name][i], x, config=tiling[name], **ops)

            for i in range(L):
                proj("qkv_proj", i, r, norm=(ln1, eps), h=x)
                proj("o_proj", i, attn_out, into=r, h=x)
                if glu:
                    act = proj("gate_up_proj", i, r, norm=(ln2, eps), glu=True)
                    x = proj("down_proj", i, act)
                    continue
                gu = proj("gate_up_proj", i, r, norm=(ln2, eps))
                x = proj("down_proj", i, gu, silu=True)
            return x, r

        return chain

    # the fused chain computes what the unfused one does (its output and stream after L layers)
    want = [t.clone() for t in unfused()]
    # (a GLU program pairs a gate row with its up row: at least two rows)
    glu_tiling = {k: dataclasses.replace(c, block_n=max(c.block_n, 2)) for k, c in best.items()}
    for chain_fn in (fused(best), fused(glu_tiling, glu=True)):
        got = [t.clone() for t in chain_fn()]
        for a, b in zip(got, want):
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            tol = 0.1 if args.fp8 else 2e-2  # (_scaled_mm rounds x to E4M3 too)
            assert rel < tol, f"the GEMV chain is {rel:.3g} off the unfused chain"
    weight_bytes = sum(n * k * wsize for n, k in SHAPES.values()) * L
    floor = weight_bytes / gbs / 1e6
    chain = {"floor_ms": floor, "layers": L}
    chain["cublas_flashinfer_ms"] = graph_ms(unfused, args.runs)
    # one tiling for every projection (the engine's knob takes one): the least time summed
    uniform = min(configs, key=lambda c: sum(r["gemv_us"][str(c)] for r in out["alone"]))
    tilings = {"best": best, "uniform": dict.fromkeys(SHAPES, uniform)}
    for name, tiling in tilings.items():
        chain[f"gemv_{name}_ms"] = graph_ms(fused(tiling), args.runs)
    if uniform.block_n >= 2:  # the activation out of gate_up's GEMV (a gate row, its up row)
        chain["gemv_uniform_glu_ms"] = graph_ms(fused(tilings["uniform"], True), args.runs)
    # each tiling of --chain-configs for every projection, as the engine runs them (the GLU
    # where a program has two rows): the norms' prologues read x once a program, so a chain
    # can favour more rows a program than the projections alone do
    chain["tilings_ms"] = {}
    chain_tilings = [GemvConfig.parse(t) for t in args.chain_configs.split()]
    for c in chain_tilings:
        ms = graph_ms(fused(dict.fromkeys(SHAPES, c), c.block_n >= 2), args.runs)
        chain["tilings_ms"][str(c)] = ms
        print(f"  GEMV chain under {c} for every projection: {ms:.3f} ms")
    if args.fp8:  # E4M3 loads of 8 values (x's layout) beside 16, every tiling tried
        chain["fp8_load_8_ms"] = {}
        for c in dict.fromkeys([uniform, *chain_tilings]):
            triton_gemv.FP8_LOAD = 8
            try:
                run = fused(dict.fromkeys(SHAPES, c), c.block_n >= 2)
                for a, b in zip([t.clone() for t in run()], want):
                    rel = float((a.float() - b.float()).norm() / b.float().norm())
                    assert rel < 0.1, f"the GEMV chain of 8-value loads is {rel:.3g} off"
                ms = graph_ms(run, args.runs)
            finally:
                triton_gemv.FP8_LOAD = 16
            chain["fp8_load_8_ms"][str(c)] = ms
            print(f"  GEMV chain under {c}, E4M3 loads of 8 values: {ms:.3f} ms")
    chain["best_configs"] = {k: str(v) for k, v in best.items()}
    chain["uniform_config"] = str(uniform)
    out["chain"] = chain
    print(
        f"chain of {L} layers without attention ({weight_bytes / 1e9:.2f} GB): "
        f"floor {floor:.3f} ms, cuBLAS + FlashInfer {chain['cublas_flashinfer_ms']:.3f} ms"
    )
    for name in tilings:
        print(f"  GEMVs, the {name} tiling: {chain[f'gemv_{name}_ms']:.3f} ms")
    if "gemv_uniform_glu_ms" in chain:
        print(f"  GEMVs, the uniform tiling, SiLU * up out of gate_up's GEMV: "
              f"{chain['gemv_uniform_glu_ms']:.3f} ms")  # fmt: skip
    gemv_ms = min(v for k, v in chain.items() if k.startswith("gemv_uniform"))
    chain["gemv_leads"] = gemv_ms < chain["cublas_flashinfer_ms"]
    ratio = gemv_ms / chain["cublas_flashinfer_ms"]
    print(f"gemv leads: {int(chain['gemv_leads'])} (x{ratio:.3f} the cuBLAS chain's time)")
    print(f"best uniform tiling: {uniform}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


# --- smallgemm ---------------------------------------------------------------------------------

SMALL_GEMM_CONFIGS = "16:256:4:4 32:256:4:4 64:128:4:4 16:128:4:6 32:128:4:6 16:512:4:3 32:256:8:4"


def layer_chain(proj, inputs: list[torch.Tensor], layers: int):
    """A chain of `layers` layers without attention: FlashInfer's add + RMSNorm, qkv, o (of a
    fixed attention output), add + RMSNorm, gate_up, SiLU * up, down; proj(name, i, x) is the
    i-th layer's projection `name` of x. inputs: the stream, the first layer's input and the
    attention's output, [M, HIDDEN] each."""
    import flashinfer

    r0, h0, attn_out = inputs
    residual = r0.clone()
    ln = torch.ones(HIDDEN, device=r0.device, dtype=r0.dtype)

    def run():
        r, x = residual.copy_(r0), h0.clone()
        for i in range(layers):
            flashinfer.norm.fused_add_rmsnorm(x, r, ln, 1e-5)
            proj("qkv_proj", i, x)
            a = proj("o_proj", i, attn_out)
            flashinfer.norm.fused_add_rmsnorm(a, r, ln, 1e-5)
            gu = proj("gate_up_proj", i, a)
            x = proj("down_proj", i, flashinfer.activation.silu_and_mul(gu))
        return x, r

    return run


def fused_chain(proj, inputs: list[torch.Tensor], layers: int):
    """layer_chain's layers as the engine's small steps run them (DecoderLayer.small_layer):
    proj(name, i, x, **ops) is the i-th layer's projection `name` of x carrying `ops`
    (small_gemm's). Each layer adds o's and down's outputs into the stream and hands the next
    norm its input; its run returns the stream after the last layer, the sum of
    layer_chain's pair."""
    r0, h0, attn_out = inputs
    residual = r0.clone()
    ln = (torch.ones(HIDDEN, device=r0.device, dtype=r0.dtype), 1e-5)

    def run():
        r = residual.copy_(r0)
        r += h0  # the unfused chain's first add
        normed = prenorm(r, *ln)
        for i in range(layers):
            proj("qkv_proj", i, normed)
            normed = proj("o_proj", i, attn_out, into=r, norm=ln)  # r + o(attention)
            act = proj("gate_up_proj", i, normed, glu=True)
            normed = proj("down_proj", i, act, into=r, norm=ln if i < layers - 1 else None)
        return r

    return run


@torch.no_grad()
def main_smallgemm() -> None:
    """Few-row projections: cuBLAS against Prism's Triton small GEMMs.

    Llama-3.1-8B's shapes, bf16, on one GPU, in the same run, for each batch of `--rows`:
    1. each projection alone, the weight cold (a CUDA graph of `--layers` projections, each of its
       own copy of the weight, so that none is in the L2): cuBLAS (torch's linear) and the small
       GEMM under each tiling of `--configs`, against the HBM floor (the bytes over a copy's rate);
    2. each projection alone carrying the ops of a small layer (qkv and gate_up after a norm,
       gate_up making SiLU * up, o and down into the stream handing the next norm its input),
       under each tiling;
    3. a layer's chain without its attention, `--layers` deep in one graph, FlashInfer's add +
       RMSNorm and SiLU * up between the projections: cuBLAS's GEMMs (the engine's default) against
       the small GEMMs under the one tiling that led over all four projections in 1, and under the
       default tiling (SmallGemmConfig(): its wide tiling for gate_up), against the chain's floor
       (its weights' bytes over the copy rate);
    4. the same chain as the engine's small layers run it (DecoderLayer.small_layer): four small
       GEMMs a layer carrying the norms, the residual's adds and SiLU * up (no kernel between
       them), under the default tiling and the one that led in 1.
    The tiling that led at the most rows is printed last ("best uniform tiling: ...").

        python3 scripts/bench_kernels.py smallgemm [--rows "16 8"] [--configs "16:256:4:4"]
    """
    ap = argparse.ArgumentParser(description=main_smallgemm.__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16 8 4", help="batch sizes (rows of x), at most 16")
    ap.add_argument("--configs", default=SMALL_GEMM_CONFIGS, help="tilings BN:BK:WARPS:STAGES")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (cuBLAS: torch._scaled_mm)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "rows": {}, "fp8": args.fp8}
    gbs, wsize = out["hbm_gbs"], weight_size(args.fp8)
    configs = [SmallGemmConfig.parse(c) for c in args.configs.split()]
    rows = [int(r) for r in args.rows.split()]
    layers = {name: linears(n, k, args.layers, dev, args.fp8) for name, (n, k) in SHAPES.items()}
    L = args.layers
    tol = 0.1 if args.fp8 else 2e-2  # (_scaled_mm rounds x to E4M3 too)
    weight_bytes = sum(n * k * wsize for n, k in SHAPES.values()) * L
    lead_at_most = None
    for m in sorted(rows, reverse=True):
        per: dict = {"alone": []}
        # 1. each projection alone, cold
        for name, (n, k) in SHAPES.items():
            lins = layers[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor = n * k * wsize / gbs / 1e6 * 1e3  # us
            cublas = graph_ms(lambda lins=lins, x=x: [lin(x) for lin in lins], args.runs)
            row = {"gemm": name, "floor_us": floor, "cublas_us": cublas / L * 1e3, "small_us": {}}
            want = lins[0](x)
            for c in configs:
                close(small_gemm(lins[0], x, c), want, args.fp8)
                fn = lambda c=c, ls=lins, x=x: [small_gemm(w, x, c) for w in ls]  # noqa: E731
                row["small_us"][str(c)] = graph_ms(fn, args.runs) / L * 1e3
            per["alone"].append(row)
            print(
                f"M={m} {name} ({n}x{k}): floor {floor:.1f} us, cuBLAS {row['cublas_us']:.1f} us,"
                " small " + ", ".join(f"{c} {v:.1f}" for c, v in row["small_us"].items()) + " us"
            )
        # 2. each projection alone as a fused layer runs it (the ops it carries)
        ln = (torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16), 1e-5)
        stream = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
        normed = prenorm(stream, *ln)
        carried = {  # name -> (x, ops)
            "qkv_proj": (normed, {}),
            "o_proj": (None, {"into": stream, "norm": ln}),
            "gate_up_proj": (normed, {"glu": True}),
            "down_proj": (None, {"into": stream, "norm": ln}),
        }
        for row in per["alone"]:
            name, k = row["gemm"], SHAPES[row["gemm"]][1]
            lins, (x, ops) = layers[name], carried[name]
            if x is None:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def run(c, ls=lins, x=x, ops=ops):
                return [small_gemm(w, x, c, **ops) for w in ls]

            row["fused_us"] = {str(c): graph_ms(lambda c=c: run(c), args.runs) / L * 1e3
                               for c in configs}  # fmt: skip
            print(
                f"M={m} fused {name} ({', '.join(['a norm'] * (x is normed) + list(ops))}): "
                + ", ".join(f"{c} {v:.1f}" for c, v in row["fused_us"].items())
                + " us"
            )
        uniform = min(configs, key=lambda c: sum(r["small_us"][str(c)] for r in per["alone"]))
        lead_at_most = lead_at_most or uniform
        # 3. the layer chain without attention, `--layers` deep
        inputs = [torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        cublas = layer_chain(lambda name, i, x: layers[name][i](x), inputs, L)
        small = layer_chain(
            lambda name, i, x, c=uniform: small_gemm(layers[name][i], x, c), inputs, L
        )
        want = [t.clone() for t in cublas()]
        got = [t.clone() for t in small()]
        for a, b in zip(got, want):
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            assert rel < tol, f"the small GEMMs' chain is {rel:.3g} off cuBLAS's"
        floor = weight_bytes / gbs / 1e6
        c_ms, s_ms = graph_ms(cublas, args.runs), graph_ms(small, args.runs)
        # the default tiling: the narrow one, the wide one for gate_up (SmallGemmConfig.for_outputs)
        auto = layer_chain(
            lambda name, i, x: small_gemm(layers[name][i], x, SmallGemmConfig()), inputs, L
        )
        a_ms = graph_ms(auto, args.runs)
        swap_ms = None
        if args.fp8:  # _scaled_mm with its operands swapped (y.T = W @ x.T)
            fp8s = [lin for ls in layers.values() for lin in ls]
            for lin in fp8s:
                lin.swap_max_rows = m
            got = [t.clone() for t in cublas()]
            for a, b in zip(got, want):
                rel = float((a.float() - b.float()).norm() / b.float().norm())
                assert rel < 2e-2, f"the swapped _scaled_mm chain is {rel:.3g} off the usual one"
            swap_ms = graph_ms(cublas, args.runs)
            for lin in fp8s:
                lin.swap_max_rows = 0
        # 4. the fused layers: the norms, adds and activation inside the small GEMMs
        fused_ms = {}
        for c in (SmallGemmConfig(), uniform):
            fused = fused_chain(
                lambda name, i, x, c=c, **ops: small_gemm(layers[name][i], x, c, **ops), inputs, L
            )
            a, b = fused().clone(), want[0].float() + want[1].float()
            rel = float((a.float() - b).norm() / b.norm())
            assert rel < tol, f"the fused small GEMMs' chain ({c}) is {rel:.3g} off cuBLAS's"
            fused_ms[str(c)] = graph_ms(fused, args.runs)
        f_ms = fused_ms[str(SmallGemmConfig())]
        per["chain"] = {"floor_ms": floor, "cublas_ms": c_ms, "small_ms": s_ms, "default_ms": a_ms,
                        "fused_ms": fused_ms, "uniform_config": str(uniform),
                        "swapped_ms": swap_ms, "layers": L}  # fmt: skip
        out["rows"][m] = per
        print(
            f"M={m} chain of {L} layers without attention ({weight_bytes / 1e9:.2f} GB): "
            f"floor {floor:.3f} ms, cuBLAS {c_ms:.3f} ms, small GEMMs ({uniform}) {s_ms:.3f} ms "
            f"(x{s_ms / c_ms:.3f} cuBLAS's), the default tiling {a_ms:.3f} ms (x{a_ms / c_ms:.3f})"
            + (f", _scaled_mm swapped {swap_ms:.3f} ms (x{swap_ms / c_ms:.3f})" if swap_ms else "")
        )
        print(
            f"M={m} fused layers (the ops inside the small GEMMs): the default tiling "
            f"{f_ms:.3f} ms (x{f_ms / c_ms:.3f} cuBLAS's chain), {uniform} "
            f"{fused_ms[str(uniform)]:.3f} ms (x{fused_ms[str(uniform)] / c_ms:.3f})"
        )
    print(f"best uniform tiling: {lead_at_most}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


# --- attn --------------------------------------------------------------------------------------

HQ, HKV, D, PAGE = 32, 8, 128, 16
ATTN_CONFIGS = (
    "16:3:2:64 16:3:2:128 16:3:2:64:8 16:3:2:128:8 16:3:2:64:2 16:4:2:64 8:3:2:64 32:3:4:64"
)


def device_us(fn, runs: int) -> float:
    """fn's kernels' device time (us), summed, per run: fn run `runs` times under the
    profiler after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for ev in prof.key_averages():
        if ev.key.startswith(("ProfilerStep", "cudaGraph", "Memcpy", "Memset")):
            continue
        total += getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
    return total / runs


def kernel_for(config: str, dev) -> TritonDecodeKernel:
    """The kernel of a setting splits:stages:waves:block_n[:warps] (the tile block_n and the
    setting's warps and stages at every batch: no wide tile, no dense launch's own)."""
    splits, stages, waves, block_n, *warps = (int(x) for x in config.split(":"))
    return TritonDecodeKernel(HQ, HKV, D, PAGE, dev, max_splits=splits, stages=stages,
                              waves=waves, block_n=block_n, wide_tile=False,
                              warps=warps[0] if warps else 4, dense=None)  # fmt: skip


def measure(b: int, args, gbs: float) -> dict:
    """One batch size's figures: the floor, Triton's under each setting, FlashInfer's (us a
    layer), after checking Triton's output against FlashInfer's."""
    import flashinfer

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    spec = LayerAttention(scale=D**-0.5)
    ctx, L = args.context, args.layers
    pages_a_seq = -(-(ctx + 1) // PAGE)
    n_pages = b * pages_a_seq + 1  # page 0: the null page
    caches = [torch.randn(n_pages, 2, PAGE, HKV, D, device=dev, dtype=bf16) for _ in range(L)]
    tables = (1 + torch.arange(b * pages_a_seq, device=dev, dtype=torch.int32)).view(b, -1)
    lens = torch.full((b, 1), ctx + 1, device=dev, dtype=torch.int32)  # with the new token
    slots = (tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE).contiguous()
    q = torch.randn(b, HQ, D, device=dev, dtype=bf16)
    k, v = (torch.randn(b, HKV, D, device=dev, dtype=bf16) for _ in range(2))
    # the rope table at position 0 (cos 1, sin 0): q and k as they are
    rope = torch.cat([torch.ones(b, D // 2), torch.zeros(b, D // 2)], 1).to(dev)
    new = (k, v, rope, slots)
    kv_bytes = b * (ctx + 1) * HKV * D * 2 * 2
    row: dict = {"floor_us": kv_bytes / gbs / 1e3, "triton_us": {}}
    for c in args.configs.split():
        kern = kernel_for(c, dev)
        row["triton_us"][c] = (
            device_us(lambda kern=kern: [kern(q, x, tables, lens, spec, new) for x in caches],
                      args.runs) / L
        )  # fmt: skip
    # where the first setting's time goes: without the rope and K/V write, and with every
    # layer over one cache (its K/V in the L2 after the first: what is left is not HBM's)
    kern = kernel_for(args.configs.split()[0], dev)
    row["variants_us"] = {
        "no rope or K/V write": device_us(
            lambda: [kern(q, x, tables, lens, spec) for x in caches], args.runs
        ) / L,
        "one cache (L2-hot)": device_us(
            lambda: [kern(q, caches[0], tables, lens, spec, new) for _ in caches], args.runs
        ) / L,
    }  # fmt: skip
    # FlashInfer's tensor-core decode over the same pages (the new K/V written by Triton's)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * pages_a_seq
    last = torch.full((b,), ctx + 1 - (pages_a_seq - 1) * PAGE, device=dev, dtype=torch.int32)
    w.plan(indptr, tables.flatten(), last, HQ, HKV, D, PAGE, q_data_type=bf16)
    row["flashinfer_us"] = device_us(lambda: [w.run(q, x) for x in caches], args.runs) / L
    got = TritonDecodeKernel(HQ, HKV, D, PAGE, dev)(q, caches[0], tables, lens, spec, new)
    torch.testing.assert_close(got, w.run(q, caches[0]), rtol=2e-2, atol=2e-2)
    return row


@torch.no_grad()
def main_attn() -> None:
    """Decode attention alone: Prism's Triton decode kernel, several settings, against FlashInfer's.

    Llama-3.1-8B's heads (32 query over 8 KV heads, head_dim 128), bf16, 16-token pages, on one GPU,
    in the same run, for each batch of `--batches` at `--context` tokens a sequence: `--layers`
    layers, each over a cache of its own (so that no layer finds its K/V in the L2), as a decode
    step runs them:
    - Triton's kernel with the step's rope and K/V write (the engine's decode kernel up to 16
      sequences), under each setting of `--configs` (splits:stages:waves:block_n[:warps]; splits
      up to 64, a build of its own past 16; the tile block_n at every batch, no wide tile; 4 warps
      unless named);
    - FlashInfer's tensor-core decode kernel (and its merge, where it splits), K/V already written
      (the engine's above 16 sequences);
    against the floor: the K/V bytes read over a 1 GiB copy's rate; and where the first setting's
    time goes: the same kernel without the rope and K/V write, and with every layer over one cache
    (L2-hot: what is left is the kernel's own latency, not HBM's). The figure is the kernels'
    device time a layer (the profiler's sum over the step's kernels, launch gaps left out).

        python3 scripts/bench_kernels.py attn [--batches "1 16"] [--context 1024] [--json F]
    """
    ap = argparse.ArgumentParser(description=main_attn.__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1 16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--configs", default=ATTN_CONFIGS, help="splits:stages:waves:block_n[:warps]")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "batches": {}}
    gbs = out["hbm_gbs"]
    for b in (int(x) for x in args.batches.split()):
        row = measure(b, args, gbs)
        out["batches"][b] = row
        best = min(row["triton_us"], key=row["triton_us"].get)
        print(
            f"B={b} ctx {args.context}: floor {row['floor_us']:.1f} us a layer, FlashInfer "
            f"{row['flashinfer_us']:.1f} us, Triton "
            + ", ".join(f"{c} {t:.1f}" for c, t in row["triton_us"].items())
            + f" us; best {best} ({row['triton_us'][best] / row['floor_us']:.2f} x the floor)"
        )
        print(
            f"B={b} {args.configs.split()[0]}: "
            + ", ".join(f"{k} {t:.1f} us" for k, t in row["variants_us"].items())
        )
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


# --- prebuild ----------------------------------------------------------------------------------

OPS = ("norm", "act:silu", "act:gelu_tanh", "page", "sampling", "rope")
DEFAULT_SHAPES = [
    *OPS,
    "decode:64",
    "decode:128",
    "decode:256:window",
    "decode:256:window:softcap",
    "fa2:64",
    "fa2:128",
    "fa2:128:window",
    "fa2:256:window",
    "fa2:256:window:softcap",
    "fa3:64",
    "fa3:128",
    "fa3:128:window",
    "fa3:256",
    "fa3:256:window",
    "fa3:256:window:softcap",
]


def parse_shape(text: str) -> tuple[str, int, bool, bool]:
    """'fa3:256:window:softcap' -> (backend, head_dim, sliding window, soft cap)."""
    backend, head_dim, *flags = text.split(":")
    unknown = set(flags) - {"window", "softcap"}
    if backend not in ("fa2", "fa3", "decode") or not head_dim.isdigit() or unknown:
        raise SystemExit(
            f"bad shape {text!r}: BACKEND(fa2|fa3|decode):HEAD_DIM[:window][:softcap],"
            f" or one of {', '.join(OPS)}"
        )
    return backend, int(head_dim), "window" in flags, "softcap" in flags


def attention_spec(backend: str, head_dim: int, window: bool, softcap: bool):
    """The JIT spec FlashInfer's paged and ragged prefill wrappers (backend fa2 or fa3), or its
    decode wrapper (backend "decode"), load for this shape with a bf16 cache and int32 indices,
    as Prism plans them (no rope in the kernel, no fp16 QK)."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    bf16 = torch.bfloat16
    if backend == "decode":
        return gen_batch_decode_module(
            bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, window, softcap
        )
    return gen_batch_prefill_module(
        backend, bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, window, softcap, False
    )


def ops_spec(name: str):
    """The JIT spec of one of FlashInfer's fused kernels' modules."""
    from flashinfer.jit import activation, norm, page, rope, sampling

    if name.startswith("act:"):
        return activation.gen_act_and_mul_module(name.split(":", 1)[1])
    return {
        "norm": norm.gen_norm_module,
        "page": page.gen_page_module,
        "sampling": sampling.gen_sampling_module,
        "rope": rope.gen_rope_module,
    }[name]()


def spec_of(text: str):
    return ops_spec(text) if text in OPS else attention_spec(*parse_shape(text))


def main_prebuild() -> None:
    """FlashInfer's modules compiled ahead, on a machine without a GPU.

    FlashInfer compiles a module the first time it is used: an attention module when a shape of
    attention meets a backend (fa3's prefill take about 80 s each on the GPU machine), and the
    modules of its small fused kernels (RMSNorm, SiLU * up, the K/V append, sampling, rope). A
    fresh GPU machine's first engine load took 255 s with six of them to compile, 29 s with none,
    which a run's few minutes cannot spare. nvcc needs no GPU: this builds the
    modules here (sm_90a), checks that each one loads, and adds them to the carried bundle
    (.fiaot/fi_aot.tar.xz), beside the modules earlier GPU runs compiled. The GPU machine then
    finds them in FlashInfer's AOT directory (`scripts/fi_kernels.sh unpack`); one that fails to
    load there is compiled again by FlashInfer, as before.

    Run by `bash scripts/fi_kernels.sh build [SHAPE ...]`, which prepares the toolchain (nvcc of the
    GPU machine's CUDA release, from PyPI) in .fibuild/. A SHAPE is
    BACKEND:HEAD_DIM[:window][:softcap],
    e.g. fa3:256:window:softcap (BACKEND fa2 or fa3 for prefill, decode for FlashInfer's decode
    kernel), or the name of one of the fused kernels' modules: norm, act:silu, act:gelu_tanh, page,
    sampling, rope. The default list covers what Prism's engine and GPU tests use.
    """
    ap = argparse.ArgumentParser(
        description=main_prebuild.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("shapes", nargs="*", default=DEFAULT_SHAPES)
    ap.add_argument("--bundle", type=Path, default=Path(".fiaot/fi_aot.tar.xz"))
    args = ap.parse_args()
    import tvm_ffi

    stage = Path(tempfile.mkdtemp(prefix="fi-aot-"))
    if args.bundle.exists():
        with tarfile.open(args.bundle) as tar:
            tar.extractall(stage, filter="data")
    before = {p.name for p in stage.iterdir()}
    print(f"{args.bundle}: {len(before)} modules")
    added = []
    for text in args.shapes:
        spec = spec_of(text)
        if spec.name in before:
            print(f"{text}: in the bundle already")
            continue
        t0 = time.perf_counter()
        spec.build(verbose=False)
        so = spec.jit_library_path
        tvm_ffi.load_module(str(so))  # links and registers its functions: catches a bad build here
        (stage / spec.name).mkdir()
        shutil.copy2(so, stage / spec.name / f"{spec.name}.so")
        added.append(spec.name)
        print(f"{text}: built in {time.perf_counter() - t0:.0f} s ({so.stat().st_size >> 10} KiB)")
    if added:
        args.bundle.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.bundle.with_suffix(".new")
        with tarfile.open(tmp, "w:xz", preset=9) as tar:
            for p in sorted(stage.iterdir()):
                tar.add(p, arcname=f"./{p.name}")
        tmp.replace(args.bundle)
    shutil.rmtree(stage)
    size = args.bundle.stat().st_size / 2**20 if args.bundle.exists() else 0
    print(f"{args.bundle}: {len(before) + len(added)} modules, {size:.1f} MiB (+{len(added)})")


# --- lora --------------------------------------------------------------------------------------

LORA_MODULES = {  # module -> (columns of its input, its shards' output rows)
    "qkv_proj": (HIDDEN, (4096, 1024, 1024)),
    "o_proj": (HIDDEN, (HIDDEN,)),
    "gate_up_proj": (HIDDEN, (INTER, INTER)),
    "down_proj": (INTER, (HIDDEN,)),
}


def lora_layers(distinct: int, slots: int, rank: int, layers: int, dev) -> tuple[list, int]:
    """Per layer and module (LORA_MODULES): (its table [slots, 1 + 3 J] int64 holding `distinct`
    adapters' random weights in slots 0.., bounds int32 [J + 1], J, widest shard, K, outputs)
    and the tensors it points at (kept alive); -> (those, one adapter's bytes)."""
    from models.kernels import triton_lora

    out, keep, size = [], [], 0
    for _ in range(layers):
        for k, rows in LORA_MODULES.values():
            j = len(rows)
            table = torch.zeros(slots, 1 + 3 * j, dtype=torch.int64)
            for s in range(distinct):
                a = torch.randn(j * rank, k, device=dev, dtype=torch.bfloat16) * k**-0.5
                entry = [a.data_ptr()]
                keep.append(a)
                for i, n in enumerate(rows):
                    b = torch.randn(n, rank, device=dev, dtype=torch.bfloat16) * 0.1
                    entry += [b.data_ptr(), rank, i * rank]
                    keep.append(b)
                table[s] = torch.tensor(entry)
            size += sum(rank * (k + n) * 2 for n in rows)
            bounds = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
            out.append((table.to(dev), bounds.to(dev), j, max(rows), k, sum(rows)))
    assert triton_lora.NO_SLOT == -1
    return [out, keep], size


def lora_run(d: int, args, gbs: float) -> dict:
    """main_lora's figures (us a step) for `d` distinct adapters."""
    from models.kernels import triton_lora
    from models.kernels.triton_lora import (
        DECODE_BLOCK_M,
        TokenGroups,
        expand,
        max_tiles,
        pack_groups,
        shrink,
    )

    dev, b = torch.device("cuda"), args.batch
    (mods, _keep), one = lora_layers(d, args.slots, args.rank, args.layers, dev)
    xs = [torch.randn(b, m[4], device=dev, dtype=torch.bfloat16) for m in mods]
    ys = [torch.zeros(b, m[5], device=dev, dtype=torch.bfloat16) for m in mods]
    values, tiles, _ = pack_groups([i % d for i in range(b)], args.slots, b, DECODE_BLOCK_M)
    buf = torch.tensor(values, dtype=torch.int32, device=dev)

    def groups(tiles: int) -> TokenGroups:
        return TokenGroups(buf, b, args.slots, DECODE_BLOCK_M, tiles)

    def chain(g: TokenGroups, do_shrink=True, do_expand=True, hs=None):
        def run():
            for i, (table, bounds, j, widest, _, _) in enumerate(mods):
                h = shrink(xs[i], table, g, j, 16) if do_shrink else hs[i]
                if do_expand:
                    expand(h, ys[i], table, bounds, g, widest)

        return run

    def result(fn) -> list[torch.Tensor]:
        for y in ys:
            y.zero_()
        fn()
        return [y.clone() for y in ys]

    full = groups(min(1 << (tiles - 1).bit_length(), max_tiles(b, args.slots, DECODE_BLOCK_M)))
    want = result(chain(full))
    hs = [shrink(xs[i], m[0], full, m[2], 16) for i, m in enumerate(mods)]
    row = {"floor_us": d * one / gbs / 1e3}
    variants = {
        "graph (tiles to a power of 2)": (full, {}),
        "shrink alone": (full, {"do_expand": False}),
        "expand alone": (full, {"do_shrink": False, "hs": hs}),
        "the step's tiles": (groups(tiles), {}),
        "every tile a batch can have": (groups(max_tiles(b, args.slots, DECODE_BLOCK_M)), {}),
    }
    for v in args.splits.replace(",", " ").split():
        variants[f"shrink parts <= {v}"] = (full, {"splits": int(v)})
    for v in args.block_n.replace(",", " ").split():
        variants[f"expand tile {v}"] = (full, {"block_n": int(v)})
    for v in args.block_k.replace(",", " ").split():
        variants[f"shrink step {v}"] = (full, {"block_k": int(v)})
    for v in args.expand_blocks.replace(",", " ").split():
        variants[f"expand {v} row blocks a program"] = (full, {"expand_blocks": int(v)})
    knobs = {"splits": "MAX_SPLITS", "block_n": "BLOCK_N", "block_k": "BLOCK_K",
             "expand_blocks": "EXPAND_BLOCKS"}  # fmt: skip
    defaults = {key: getattr(triton_lora, name) for key, name in knobs.items()}
    try:
        for name, (g, opts) in variants.items():
            for key, knob in knobs.items():
                setattr(triton_lora, knob, opts.pop(key, defaults[key]))
            fn = chain(g, **opts)
            if not opts:  # the same deltas as the default
                for a, w in zip(result(fn), want):
                    torch.testing.assert_close(a, w, rtol=2e-2, atol=2e-2)
            row[name] = graph_ms(fn, args.runs) * 1e3
    finally:
        for key, knob in knobs.items():
            setattr(triton_lora, knob, defaults[key])
    return row


@torch.no_grad()
def main_lora() -> None:
    """A decode step's LoRA deltas alone: the shrink and expand kernels of every module of
    Llama-3.1-8B's `--layers` layers (q/k/v, o, gate/up, down; rank `--rank`), `--batch` tokens
    spread over 1, 8 .. `--distinct` adapters in `--slots` slots, one CUDA graph, against the
    floor of reading the adapters' bytes (over a copy's rate), in the same run:

    - as the engine's decode graphs run them (a grid over the step's tiles rounded up to a
      power of 2);
    - shrink alone and expand alone (where the time goes);
    - a grid over the step's tiles exactly, and over every tile a batch can have (what idle
      programs cost);
    - other splits of K in the shrink (`--splits`), its loop steps (`--block-k`), output
      rows a block in the expand (`--block-n`) and its blocks a program (`--expand-blocks`).

        python3 scripts/bench_kernels.py lora [--distinct "1 8 32"] [--batch 32]
    """
    ap = argparse.ArgumentParser(description=main_lora.__doc__.split("\n\n")[0])
    ap.add_argument("--distinct", default="1 8 32", help="adapters among the batch's tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--splits", default="4 1", help="most parts of K in the shrink, beside 16")
    ap.add_argument("--block-n", default="128 512", help="expand tiles beside the default")
    ap.add_argument("--block-k", default="", help="shrink loop steps beside the default")
    ap.add_argument("--expand-blocks", default="2 4", help="expand row blocks a program beside 1")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "batch": args.batch, "slots": args.slots, "runs": {}}
    gbs = out["hbm_gbs"]
    for d in (int(v) for v in args.distinct.replace(",", " ").split()):
        row = out["runs"][d] = lora_run(d, args, gbs)
        print(
            f"B={args.batch}, {d} distinct rank-{args.rank} adapters, {args.layers} layers: floor "
            f"{row['floor_us']:.0f} us; "
            + "; ".join(f"{k} {v:.0f} us" for k, v in row.items() if k != "floor_us"),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


COMMANDS = {
    "gemv": main_gemv,
    "smallgemm": main_smallgemm,
    "attn": main_attn,
    "lora": main_lora,
    "prebuild": main_prebuild,
}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(f"usage: bench_kernels.py {{{','.join(COMMANDS)}}} [args]; see --help")
    command = COMMANDS[sys.argv.pop(1)]
    sys.argv[0] = f"bench_kernels.py {command.__name__.removeprefix('main_')}"
    sys.exit(command())
