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
GPU machine's CUDA release, from PyPI) in .fibuild/. A SHAPE is BACKEND:HEAD_DIM[:window][:softcap],
e.g. fa3:256:window:softcap (BACKEND fa2 or fa3 for prefill, decode for FlashInfer's decode
kernel), or the name of one of the fused kernels' modules: norm, act:silu, act:gelu_tanh, page,
sampling, rope. The default list covers what Prism's engine and GPU tests use.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

OPS = ("norm", "act:silu", "act:gelu_tanh", "page", "sampling", "rope")
DEFAULT_SHAPES = [
    *OPS,
    "decode:128",
    "decode:256:window",
    "decode:256:window:softcap",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
