"""Batch-1 projections: cuBLAS against Prism's Triton GEMVs that carry the ops between them.

Llama-3.1-8B's shapes, bf16, on one GPU, in the same run:
1. each projection alone, the weight cold (a CUDA graph of `--layers` projections, each of its
   own copy of the weight, so that none is in the L2): cuBLAS (torch's linear) and the GEMV
   under each tiling of `--configs`, against the HBM floor (the bytes over a copy's rate);
2. a layer's chain without its attention, `--layers` deep in one graph: cuBLAS with FlashInfer's
   add + RMSNorm and SiLU * up between the GEMMs (the engine's default at batch 1), against the
   four GEMVs that carry them (triton_gemv), plain and as programmatic dependent launches, under
   the tiling that led in 1 for each projection, and under the one that led over all four (the
   engine's knob, PRISM_TRITON_GEMV, takes one; printed last). The chain's floor is its
   weights' bytes over the copy rate.

    python3 scripts/bench_gpu_gemv.py [--configs "8:512:4:2 16:256:4:4"] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.layers.triton_gemv import GemvConfig, gemv  # noqa: E402
from scripts.bench_gpu_l2_prefetch import gpu_start  # noqa: E402

HIDDEN, INTER, QKV = 4096, 14336, 6144
SHAPES = {  # name -> (out, in), the prologue/epilogue the chain gives it
    "qkv_proj": (QKV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
}
CONFIGS = (
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


def linears(n: int, k: int, count: int, dev) -> list[torch.nn.Linear]:
    out = []
    for _ in range(count):
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        torch.nn.init.normal_(lin.weight, std=k**-0.5)
        out.append(lin)
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=CONFIGS, help="GEMV tilings BN:BK:WARPS:UNROLL")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "alone": []}
    gbs = out["hbm_gbs"]
    configs = [GemvConfig.parse(c) for c in args.configs.split()]
    layers = {name: linears(n, k, args.layers, dev) for name, (n, k) in SHAPES.items()}
    best: dict[str, GemvConfig] = {}
    # 1. each projection alone, cold
    for name, (n, k) in SHAPES.items():
        lins = layers[name]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        floor = n * k * 2 / gbs / 1e6 * 1e3  # us
        cublas = graph_ms(lambda lins=lins, x=x: [lin(x) for lin in lins], args.runs)
        cublas = cublas / len(lins) * 1e3
        row = {"gemm": name, "floor_us": floor, "cublas_us": cublas, "gemv_us": {}}
        for c in configs:
            want = lins[0](x)
            got = gemv(lins[0], x, config=c)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
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

    def fused(pdl: bool, tiling: dict[str, GemvConfig], glu: bool = False):
        """glu: SiLU * up made by gate_up's GEMV, the down GEMV a plain one."""

        def chain():
            r, x = residual.copy_(residual0), h0.clone()

            def proj(name: str, i: int, x, **ops):
                return gemv(layers[name][i], x, config=tiling[name], pdl=pdl, **ops)

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
    for chain_fn in (fused(False, best), fused(False, glu_tiling, glu=True)):
        got = [t.clone() for t in chain_fn()]
        for a, b in zip(got, want):
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            assert rel < 2e-2, f"the GEMV chain is {rel:.3g} off the unfused chain"
    weight_bytes = sum(n * k * 2 for n, k in SHAPES.values()) * L
    floor = weight_bytes / gbs / 1e6
    chain = {"floor_ms": floor, "layers": L}
    chain["cublas_flashinfer_ms"] = graph_ms(unfused, args.runs)
    # one tiling for every projection (the engine's knob takes one): the least time summed
    uniform = min(configs, key=lambda c: sum(r["gemv_us"][str(c)] for r in out["alone"]))
    tilings = {"best": best, "uniform": dict.fromkeys(SHAPES, uniform)}
    pdl_ok = torch.cuda.get_device_capability(dev) >= (9, 0)
    for name, tiling in tilings.items():
        chain[f"gemv_{name}_ms"] = graph_ms(fused(False, tiling), args.runs)
        if pdl_ok:
            chain[f"gemv_{name}_pdl_ms"] = graph_ms(fused(True, tiling), args.runs)
    if uniform.block_n >= 2:  # the activation out of gate_up's GEMV (a gate row, its up row)
        chain["gemv_uniform_glu_ms"] = graph_ms(fused(False, tilings["uniform"], True), args.runs)
    chain["best_configs"] = {k: str(v) for k, v in best.items()}
    chain["uniform_config"] = str(uniform)
    out["chain"] = chain
    print(
        f"chain of {L} layers without attention ({weight_bytes / 1e9:.2f} GB): "
        f"floor {floor:.3f} ms, cuBLAS + FlashInfer {chain['cublas_flashinfer_ms']:.3f} ms"
    )
    for name in tilings:
        pdl = f", with PDL {chain[f'gemv_{name}_pdl_ms']:.3f} ms" if pdl_ok else ""
        print(f"  GEMVs, the {name} tiling: {chain[f'gemv_{name}_ms']:.3f} ms{pdl}")
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


if __name__ == "__main__":
    main()
