"""Which FlashInfer kernels attention runs: read from the environment once, when an engine is
built, validated, and handed to every device's shared resources (so every runner's backend)."""

from __future__ import annotations

import pytest

from models.attention.flashinfer_paged import DEFAULT_KERNELS, KernelChoice
from prism_server import envs
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine


def test_the_defaults_and_a_bad_backend():
    assert KernelChoice(True, "auto", 1024, ragged_prefill=True) == DEFAULT_KERNELS
    assert envs.prefill_backend() == "auto" and envs.prefill_backend_min_tokens() == 1024
    assert KernelChoice(prefill_backend="fa3").prefill_backend == "fa3"
    # the chosen backend from 1024 query tokens a step; fa2 below
    assert [DEFAULT_KERNELS.prefill_backend_for(n) for n in (1, 1023, 1024)] == [
        "fa2",
        "fa2",
        "auto",
    ]
    assert (
        KernelChoice(prefill_backend="fa3", prefill_backend_min_tokens=0).prefill_backend_for(1)
        == "fa3"
    )
    with pytest.raises(ValueError, match="prefill backend min tokens -1"):
        KernelChoice(prefill_backend_min_tokens=-1)
    with pytest.raises(ValueError, match="choose from fa2, fa3, auto"):
        KernelChoice(prefill_backend="fa4")
    assert KernelChoice().decode_plan_kwargs() == {}
    no_split = KernelChoice(decode_backend="flashinfer", decode_split_pages=0)
    split_16 = KernelChoice(decode_backend="flashinfer", decode_split_pages=16)
    assert no_split.decode_plan_kwargs() == {"disable_split_kv": True}
    assert split_16.decode_plan_kwargs() == {"fixed_split_size": 16}
    # a graph replays what its capture planned: the split choice is for eager steps
    assert no_split.decode_plan_kwargs(graph=True) == split_16.decode_plan_kwargs(graph=True) == {}
    with pytest.raises(ValueError, match="splits the KV itself"):
        KernelChoice(decode_split_pages=16)  # the default decode kernel: Triton's
    assert KernelChoice(triton_max_splits=32).triton_max_splits == 32  # a wider merge's build
    with pytest.raises(ValueError, match="65 splits"):
        KernelChoice(triton_max_splits=65)
    with pytest.raises(ValueError, match="0 waves"):
        KernelChoice(triton_waves=0)
    with pytest.raises(ValueError, match="3 warps"):
        KernelChoice(triton_warps=3)
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        KernelChoice(triton_dense=(3, 2))
    for n in (16, 0):
        with pytest.raises(ValueError, match="tensor-core decode kernel"):
            KernelChoice(False, decode_split_pages=n, decode_backend="flashinfer")
    with pytest.raises(ValueError, match="decode split of -1 pages"):
        KernelChoice(decode_backend="flashinfer", decode_split_pages=-1)
    assert DEFAULT_KERNELS.decode_backend == "triton"
    assert DEFAULT_KERNELS.decode_backend_max_batch == 16 == envs.decode_backend_max_batch()
    with pytest.raises(ValueError, match="choose from flashinfer, xqa, triton"):
        KernelChoice(decode_backend="trtllm")
    with pytest.raises(ValueError, match="splits the KV itself"):
        KernelChoice(decode_backend="xqa", decode_split_pages=16)
    with pytest.raises(ValueError, match="max batch 0"):
        KernelChoice(decode_backend="triton", decode_backend_max_batch=0)
    assert DEFAULT_KERNELS.fused_rope_write
    assert DEFAULT_KERNELS.l2_prefetch_mib == (0, 0, 0) == envs.l2_prefetch_mib()
    for bad in ((32, -1, 0), (32, 8)):
        with pytest.raises(ValueError, match="L2 prefetch budgets"):
            KernelChoice(l2_prefetch_mib=bad)


def test_the_environment_reaches_every_devices_resources(monkeypatch):
    monkeypatch.setenv("PRISM_DECODE_TENSOR_CORES", "0")
    monkeypatch.setenv("PRISM_PREFILL_BACKEND", "fa3")
    monkeypatch.setenv("PRISM_RAGGED_PREFILL", "0")
    monkeypatch.setenv("PRISM_PREFILL_BACKEND_MIN_TOKENS", "0")
    assert not envs.decode_tensor_cores() and envs.prefill_backend() == "fa3"
    assert not envs.ragged_prefill()
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, devices=2)) as e:
        kinds = {w.resources.kernels for w in e._workers}
        assert kinds == {KernelChoice(False, "fa3", 0, ragged_prefill=False)}
        assert e.worker.resources.xqa_workspace() is None  # not chosen: never allocated
        e.check_integrity()
    monkeypatch.setenv("PRISM_DECODE_SPLIT_PAGES", "0")  # needs FlashInfer's tensor-core kernel
    monkeypatch.setenv("PRISM_DECODE_BACKEND", "flashinfer")
    with pytest.raises(ValueError, match="decode split of 0 pages"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
    monkeypatch.delenv("PRISM_DECODE_TENSOR_CORES")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.kernels.decode_split_pages == 0
        e.check_integrity()
    monkeypatch.delenv("PRISM_DECODE_SPLIT_PAGES")
    monkeypatch.setenv("PRISM_DECODE_BACKEND", "xqa")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.kernels.decode_backend == "xqa"
        e.check_integrity()
    monkeypatch.setenv("PRISM_DECODE_BACKEND", "triton")
    monkeypatch.setenv("PRISM_DECODE_BACKEND_MAX_BATCH", "64")
    monkeypatch.setenv("PRISM_ROPE_WRITE", "0")
    monkeypatch.setenv("PRISM_TRITON_SPLITS", "8")
    monkeypatch.setenv("PRISM_TRITON_STAGES", "1")
    monkeypatch.setenv("PRISM_TRITON_WAVES", "8")
    monkeypatch.setenv("PRISM_L2_PREFETCH", "34,12")
    monkeypatch.setenv("PRISM_TRITON_PDL", "1")
    monkeypatch.setenv("PRISM_L2_PREFETCH_INLINE", "1")
    monkeypatch.setenv("PRISM_TRITON_STEP_OPS", "1")
    monkeypatch.setenv("PRISM_L2_PREFETCH_KEEP", "1")
    monkeypatch.setenv("PRISM_TRITON_WIDE_TILE", "0")
    monkeypatch.setenv("PRISM_TRITON_WARPS", "2")
    monkeypatch.setenv("PRISM_TRITON_DENSE", "8:4")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        kernels = e.worker.resources.kernels
        assert kernels.decode_backend == "triton" and kernels.decode_backend_max_batch == 64
        assert (kernels.triton_max_splits, kernels.triton_stages) == (8, 1)
        assert kernels.triton_waves == 8 and DEFAULT_KERNELS.triton_waves == 2
        assert kernels.triton_pdl and not DEFAULT_KERNELS.triton_pdl
        assert kernels.l2_prefetch_inline and not DEFAULT_KERNELS.l2_prefetch_inline
        assert kernels.triton_step_ops and not DEFAULT_KERNELS.triton_step_ops
        assert kernels.l2_prefetch_keep and not DEFAULT_KERNELS.l2_prefetch_keep
        assert not kernels.triton_wide_tile and DEFAULT_KERNELS.triton_wide_tile
        assert kernels.triton_warps == 2 and DEFAULT_KERNELS.triton_warps == 4
        assert kernels.triton_dense == (8, 4) and DEFAULT_KERNELS.triton_dense == (2, 2)
        assert not kernels.fused_rope_write and kernels.l2_prefetch_mib == (34, 12, 0)
        e.check_integrity()
    for v, mib in (
        ("40", (40, 0, 0)),
        ("0,16,8", (0, 16, 8)),
        ("48:12", (48, 12, 0)),
        ("", (0,) * 3),
    ):
        monkeypatch.setenv("PRISM_L2_PREFETCH", v)
        assert envs.l2_prefetch_mib() == mib
    for bad in ("1,2,3,4", "lots", "8,,8"):
        monkeypatch.setenv("PRISM_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match=r"PRISM_L2_PREFETCH must be A\[,M\[,N\]\]"):
            Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
    for v, dense in (("0", None), ("1", (2, 2)), ("", (2, 2)), ("4:3", (4, 3))):
        monkeypatch.setenv("PRISM_TRITON_DENSE", v)
        assert envs.triton_dense(DEFAULT_KERNELS.triton_dense) == dense
    for bad in ("2", "2:2:2", "x"):
        monkeypatch.setenv("PRISM_TRITON_DENSE", bad)
        with pytest.raises(ValueError, match="PRISM_TRITON_DENSE must be 0, 1 or WARPS:STAGES"):
            envs.triton_dense(DEFAULT_KERNELS.triton_dense)
    monkeypatch.delenv("PRISM_TRITON_DENSE")
    monkeypatch.delenv("PRISM_L2_PREFETCH")
    monkeypatch.delenv("PRISM_TRITON_PDL")
    monkeypatch.delenv("PRISM_L2_PREFETCH_INLINE")
    monkeypatch.delenv("PRISM_TRITON_STEP_OPS")
    monkeypatch.delenv("PRISM_L2_PREFETCH_KEEP")
    monkeypatch.delenv("PRISM_DECODE_BACKEND_MAX_BATCH")
    monkeypatch.delenv("PRISM_ROPE_WRITE")
    monkeypatch.delenv("PRISM_TRITON_SPLITS")
    monkeypatch.delenv("PRISM_TRITON_STAGES")
    monkeypatch.setenv("PRISM_DECODE_BACKEND", "xqa2")
    with pytest.raises(ValueError, match="decode backend 'xqa2'"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
    monkeypatch.delenv("PRISM_DECODE_BACKEND")
    monkeypatch.setenv("PRISM_PREFILL_BACKEND", "fa4")
    with pytest.raises(ValueError, match="fa4"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))


def test_piecewise_buckets_and_their_knob(monkeypatch):
    """Powers of two to 512, then every 256 tokens (padding a large step costs GEMM time); the
    knob reaches every device's resources, and a bad value is refused."""
    from prism_server.piecewise_graphs import DEFAULT_TOKEN_BUCKETS, token_buckets

    assert DEFAULT_TOKEN_BUCKETS == (8, 16, 32, 64, 128, 256, 512, 768, 1024)
    assert token_buckets(2048) == (8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert token_buckets(1000) == (8, 16, 32, 64, 128, 256, 512, 768, 1000)
    assert token_buckets(100) == (8, 16, 32, 64, 100) and token_buckets(4) == ()
    monkeypatch.setenv("PRISM_PIECEWISE_MAX_TOKENS", "2048")
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.piecewise_buckets == token_buckets(2048)
        e.check_integrity()
    monkeypatch.setenv("PRISM_PIECEWISE_GRAPHS", "0")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.piecewise_buckets == ()
        e.check_integrity()
    monkeypatch.setenv("PRISM_PIECEWISE_MAX_TOKENS", "4")
    with pytest.raises(ValueError, match="PRISM_PIECEWISE_MAX_TOKENS must be at least 8"):
        Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
    monkeypatch.setenv("PRISM_PREFILL_BACKEND_MIN_TOKENS", "-4")
    with pytest.raises(ValueError, match="PRISM_PREFILL_BACKEND_MIN_TOKENS must be >= 0"):
        envs.prefill_backend_min_tokens()


def test_the_gemv_knob(monkeypatch):
    """PRISM_TRITON_GEMV: on by default (1: the default tiling), 0 off, or a tiling; a bad one
    is refused when the engine is built. PRISM_TRITON_GEMV_GLU: on by default, 0 off."""
    from models.layers.triton_gemv import GemvConfig

    assert DEFAULT_KERNELS.triton_gemv == GemvConfig() and envs.triton_gemv() == ()
    assert DEFAULT_KERNELS.triton_gemv_glu and envs.triton_gemv_glu()
    assert str(GemvConfig()) == "2:2048:4:2"
    for v, want in (("0", None), ("1", ()), ("16:256", (16, 256)), ("8,512,8,1", (8, 512, 8, 1))):
        monkeypatch.setenv("PRISM_TRITON_GEMV", v)
        assert envs.triton_gemv() == want
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    monkeypatch.setenv("PRISM_TRITON_GEMV", "16:256")
    monkeypatch.setenv("PRISM_TRITON_GEMV_GLU", "0")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        assert e.worker.resources.kernels.triton_gemv == GemvConfig(16, 256)
        assert not e.worker.resources.kernels.triton_gemv_glu
        e.check_integrity()
    for bad, match in (("wide", "PRISM_TRITON_GEMV must be"), ("12:256", "GEMV block_n 12")):
        monkeypatch.setenv("PRISM_TRITON_GEMV", bad)
        with pytest.raises(ValueError, match=match):
            Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))


def test_the_small_gemm_knob(monkeypatch):
    """PRISM_TRITON_SMALL_GEMM: on by default (1: the default tiling; off on an H200), 0 off, or
    a tiling, with the wide projections' after a '/'; an engine built with it checks the kernel
    and its decode graphs of a few rows take it; a bad tiling is refused when the engine is
    built."""
    from models.layers.triton_small_gemm import SmallGemmConfig

    assert DEFAULT_KERNELS.triton_small_gemm == SmallGemmConfig()
    assert envs.triton_small_gemm() == ""
    # unset: off on the GPUs where the default tiling measured slower than cuBLAS (the H200)
    assert envs.triton_small_gemm("NVIDIA H200") is None
    assert envs.triton_small_gemm("NVIDIA H100 80GB HBM3") == ""
    cases = (("0", None), ("1", ""), ("32:128", "32:128"), ("16,64,2,3", "16,64,2,3"),
             ("32:256:4:4/64:128:4:4", "32:256:4:4/64:128:4:4"))  # fmt: skip
    for v, want in cases:
        monkeypatch.setenv("PRISM_TRITON_SMALL_GEMM", v)
        assert envs.triton_small_gemm() == want
        assert envs.triton_small_gemm("NVIDIA H200") == want  # asked: on the H200 too
    spec = ModelSpec("a", "dummy:tiny-llama", block_size=4)
    monkeypatch.setenv("PRISM_TRITON_SMALL_GEMM", "16:64/32:128")
    with Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10)) as e:
        want = SmallGemmConfig(16, 64, wide=SmallGemmConfig(32, 128))
        assert e.worker.resources.kernels.triton_small_gemm == want
        e.check_integrity()
    for bad, match in (
        ("wide", "PRISM_TRITON_SMALL_GEMM must be"),
        ("16:64/", "PRISM_TRITON_SMALL_GEMM must be"),
        ("8:64", "block_n 8"),
        ("16:64/8:64", "block_n 8"),
    ):
        monkeypatch.setenv("PRISM_TRITON_SMALL_GEMM", bad)
        with pytest.raises(ValueError, match=match):
            Engine(EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10))
