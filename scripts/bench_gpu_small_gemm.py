"""Few-row projections: cuBLAS against Prism's Triton small GEMMs (models.layers.triton_small_gemm).

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

    python3 scripts/bench_gpu_small_gemm.py [--rows "16 8"] [--configs "16:256:4:4"] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.layers.triton_small_gemm import SmallGemmConfig, prenorm, small_gemm  # noqa: E402
from scripts.bench_gpu_gemv import HIDDEN, SHAPES, graph_ms, linears  # noqa: E402
from scripts.bench_gpu_l2_prefetch import gpu_start  # noqa: E402

CONFIGS = "16:256:4:4 32:256:4:4 64:128:4:4 16:128:4:6 32:128:4:6 16:512:4:3 32:256:8:4"


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
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16 8 4", help="batch sizes (rows of x), at most 16")
    ap.add_argument("--configs", default=CONFIGS, help="tilings BN:BK:WARPS:STAGES")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "rows": {}}
    gbs = out["hbm_gbs"]
    configs = [SmallGemmConfig.parse(c) for c in args.configs.split()]
    rows = [int(r) for r in args.rows.split()]
    layers = {name: linears(n, k, args.layers, dev) for name, (n, k) in SHAPES.items()}
    L = args.layers
    weight_bytes = sum(n * k * 2 for n, k in SHAPES.values()) * L
    lead_at_most = None
    for m in sorted(rows, reverse=True):
        per: dict = {"alone": []}
        # 1. each projection alone, cold
        for name, (n, k) in SHAPES.items():
            lins = layers[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            floor = n * k * 2 / gbs / 1e6 * 1e3  # us
            cublas = graph_ms(lambda lins=lins, x=x: [lin(x) for lin in lins], args.runs)
            row = {"gemm": name, "floor_us": floor, "cublas_us": cublas / L * 1e3, "small_us": {}}
            want = lins[0](x)
            for c in configs:
                got = small_gemm(lins[0], x, c)
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
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
            assert rel < 2e-2, f"the small GEMMs' chain is {rel:.3g} off cuBLAS's"
        floor = weight_bytes / gbs / 1e6
        c_ms, s_ms = graph_ms(cublas, args.runs), graph_ms(small, args.runs)
        # the default tiling: the narrow one, the wide one for gate_up (SmallGemmConfig.for_outputs)
        auto = layer_chain(
            lambda name, i, x: small_gemm(layers[name][i], x, SmallGemmConfig()), inputs, L
        )
        a_ms = graph_ms(auto, args.runs)
        # 4. the fused layers: the norms, adds and activation inside the small GEMMs
        fused_ms = {}
        for c in (SmallGemmConfig(), uniform):
            fused = fused_chain(
                lambda name, i, x, c=c, **ops: small_gemm(layers[name][i], x, c, **ops), inputs, L
            )
            a, b = fused().clone(), want[0].float() + want[1].float()
            rel = float((a.float() - b).norm() / b.norm())
            assert rel < 2e-2, f"the fused small GEMMs' chain ({c}) is {rel:.3g} off cuBLAS's"
            fused_ms[str(c)] = graph_ms(fused, args.runs)
        f_ms = fused_ms[str(SmallGemmConfig())]
        per["chain"] = {"floor_ms": floor, "cublas_ms": c_ms, "small_ms": s_ms, "default_ms": a_ms,
                        "fused_ms": fused_ms, "uniform_config": str(uniform),
                        "layers": L}  # fmt: skip
        out["rows"][m] = per
        print(
            f"M={m} chain of {L} layers without attention ({weight_bytes / 1e9:.2f} GB): "
            f"floor {floor:.3f} ms, cuBLAS {c_ms:.3f} ms, small GEMMs ({uniform}) {s_ms:.3f} ms "
            f"(x{s_ms / c_ms:.3f} cuBLAS's), the default tiling {a_ms:.3f} ms (x{a_ms / c_ms:.3f})"
        )
        print(
            f"M={m} fused layers (the ops inside the small GEMMs): the default tiling "
            f"{f_ms:.3f} ms (x{f_ms / c_ms:.3f} cuBLAS's chain), {uniform} "
            f"{fused_ms[str(uniform)]:.3f} ms (x{fused_ms[str(uniform)] / c_ms:.3f})"
        )
    print(f"best uniform tiling: {lead_at_most}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
