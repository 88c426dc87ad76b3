"""FP8 models through the engine: the pool, the host copy and the snapshots hold FP8 bytes; a
model serves, is evicted, activated and moved with the same tokens; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.layers.causal_lm import weight_bytes as model_weight_bytes
from models.layers.fp8_linear import FP8_DTYPE, Fp8Linear
from models.loader import meta_model
from models.presets import get_preset
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call, PlanEvict
from prism_server.engine.engine import Engine
from prism_server.engine.memory_budget import weight_bytes, weight_pool_bytes
from prism_server.server_args import ConfigError, load_server_args
from scheduler.sampling_params import SamplingParams
from tests.models.test_quantization import _fp8_checkpoint, _tiny_hf_dir

PAGE = 64 << 10
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(5 + i, 25 + i)) for i in range(3)]


def _spec(name: str, quantization: str | None, **kw) -> ModelSpec:
    return ModelSpec(
        name, "dummy:tiny-llama", dtype="bfloat16", block_size=4, quantization=quantization, **kw
    )


def _buffers(e: Engine, name: str):
    """The model's WeightBuffer and host copy, read on its engine thread."""
    w = next(w for w in e.workers if w.name == e.served[name].device)
    worker = w.models[name]
    return w.execute(Call(lambda: (worker.weights.layout, worker.host.nbytes)))


def test_fp8_weights_are_what_the_pool_the_host_copy_and_the_snapshot_hold():
    bf16, fp8 = _spec("bf16", None), _spec("fp8", "fp8")
    cfg = EngineConfig(models=(bf16, fp8), device="cpu", page_bytes=PAGE, kv_budget_bytes=16 * PAGE)
    with Engine(cfg) as e:
        snaps = {n: e.model_snapshot(n) for n in ("bf16", "fp8")}
        layouts = {n: _buffers(e, n) for n in ("bf16", "fp8")}
        e.check_integrity()
    model = meta_model(ModelConfig.from_hf(get_preset("tiny-llama")), torch.bfloat16, "fp8")
    fp8_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
    rows = sum(m.out_features for m in model.modules() if isinstance(m, Fp8Linear))
    # each projection weight 1 byte instead of 2, and a float32 scale per output row
    want = snaps["bf16"].weight_bytes - fp8_params + 4 * rows
    assert snaps["fp8"].weight_bytes == want == model_weight_bytes(model)
    assert weight_bytes(fp8, CPU) == want  # the start-up sizing agrees with what was placed
    layout, host_bytes = layouts["fp8"]
    slots = {s.name: s for s in layout.slots}
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert slots[f"{qkv}.weight"].dtype == FP8_DTYPE
    assert slots[f"{qkv}.weight_scale"].dtype == torch.float32
    assert slots[f"{qkv}.weight_scale"].shape == (slots[f"{qkv}.weight"].shape[0],)
    assert slots["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert slots["lm_head.weight"].dtype == torch.bfloat16
    assert sum(s.nbytes for s in layout.slots) == want
    assert host_bytes == layout.nbytes < layouts["bf16"][0].nbytes  # the host copy: FP8 bytes
    pages = snaps["fp8"].weight_pages
    assert pages * PAGE == weight_pool_bytes(fp8, CPU, PAGE)
    assert pages < snaps["bf16"].weight_pages


def test_an_fp8_model_serves_evicts_activates_and_moves_with_the_same_tokens():
    cfg = EngineConfig(
        models=(_spec("fp8", "fp8"),),
        device="cpu",
        devices=2,
        page_bytes=PAGE,
        kv_budget_bytes=32 * PAGE,
        plan_interval_s=3600.0,
    )
    with Engine(cfg) as e:
        first = [c.token_ids for c in e.generate("fp8", PROMPTS, GREEDY)]
        assert all(len(t) == GREEDY.max_tokens for t in first)
        e.evict("fp8")
        snap = e.model_snapshot("fp8")
        assert not snap.residency.on_device and snap.weight_pages == 0
        e.check_integrity()
        e.activate("fp8")
        assert e.model_snapshot("fp8").residency.on_device
        assert [c.token_ids for c in e.generate("fp8", PROMPTS, GREEDY)] == first
        e.check_integrity()
        # moved to the other device: its FP8 bytes copied in from the host copy
        src = next(w for w in e.workers if w.name == e.served["fp8"].device)
        assert src.execute(PlanEvict("fp8"))
        dst = next(w.name for w in e.workers if w is not src)
        assert e.migrate("fp8", dst) and e.served["fp8"].device == dst
        slots = {s.name: s for s in _buffers(e, "fp8")[0].slots}
        assert slots["model.layers.1.mlp.down_proj.weight"].dtype == FP8_DTYPE
        assert [c.token_ids for c in e.generate("fp8", PROMPTS, GREEDY)] == first
        e.check_integrity()


def test_an_fp8_checkpoint_serves_the_tokens_of_its_dequantized_weights(tmp_path):
    src = _tiny_hf_dir(tmp_path / "src", bias=True)
    ckpt = _fp8_checkpoint(src, tmp_path / "fp8", "compressed-tensors", "channel")
    specs = (
        ModelSpec("fp8", str(ckpt), block_size=4, quantization="fp8"),
        ModelSpec("ref", str(ckpt / "reference"), block_size=4),  # float32, dequantized
    )
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, kv_budget_bytes=32 * PAGE)
    with Engine(cfg) as e:
        got = [c.token_ids for c in e.generate("fp8", PROMPTS, GREEDY)]
        assert got == [c.token_ids for c in e.generate("ref", PROMPTS, GREEDY)]
        # the projections at 1 byte instead of float32's 4; embeddings and LM head as they were
        assert e.model_snapshot("fp8").weight_bytes < 0.55 * e.model_snapshot("ref").weight_bytes
        e.check_integrity()


def test_bad_quantization_settings_are_refused_at_config_time():
    with pytest.raises(ValueError, match="quantization must be one of 'fp8'.*got 'int8'"):
        ModelSpec("m", "dummy:tiny-llama", quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel > 1: FP8 weights"):
        ModelSpec("m", "dummy:tiny-llama", quantization="fp8", tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"engine.models\[0\]: quantization must be one of"):
        load_server_args(models=["m=dummy:tiny-llama,quantization=fp4"])


def test_the_model_flag_takes_settings_after_the_source():
    args = load_server_args(
        models=["a=dummy:tiny-llama,quantization=fp8,max_num_seqs=8", "dummy:tiny-llama"]
    )
    a, b = args.models
    assert (a.name, a.source, a.quantization, a.max_num_seqs) == (
        "a",
        "dummy:tiny-llama",
        "fp8",
        8,
    )
    assert (b.name, b.quantization) == ("dummy:tiny-llama", None)
    assert load_server_args(models=["/d/x,y.gguf,quantization=fp8"]).models[0].source == (
        "/d/x,y.gguf"  # a comma inside the source stays there
    )
    with pytest.raises(ConfigError, match="foo: Unexpected keyword"):
        load_server_args(models=["a=dummy:tiny-llama,foo=1"])
    with pytest.raises(ConfigError, match="name is given as NAME=SOURCE"):
        load_server_args(models=["dummy:tiny-llama,name=x"])


def test_generate_takes_a_quantization_flag():
    from prism_server.cli.main import _parser

    args = _parser().parse_args(["generate", "--prompt", "p", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'int8' (choose from fp8)"
        _parser().parse_args(["generate", "--prompt", "p", "--quantization", "int8"])
