"""LoRA adapters on a tiny Llama: adapters made with `peft`, read by models.lora, decoded
through Prism's paged path against PEFT's merge_and_unload; a step mixing adapters and the
base; bad adapters refused with the problem named; the fused decode programs leave layers with
LoRA work to the model's own forward."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models.attention.base import ForwardContext
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.kernels import fused_decode
from models.kernels.triton_small_gemm import SmallGemmConfig
from models.lora import (
    NO_ADAPTER,
    AdapterError,
    LoraModule,
    LoraShard,
    LoraSlots,
    LoraWeights,
    lora_targets,
    read_adapter,
)
from models.registry import get_model_class
from tests.models.decode_step import cached_decode_step
from tests.models.lora_cases import Request, Spec, greedy, make_adapters, merged_logits, tiny_pair
from tests.models.test_parity import _tiny_hf_model

NEW_TOKENS = 6
SPECS = {
    "r4": Spec(r=4, alpha=8, std=0.2),
    "r8-rslora": Spec(r=8, alpha=4, std=0.2, extra=(("use_rslora", True),)),
    "r6-patterns": Spec(
        r=6,
        alpha=6,
        std=0.2,
        extra=(("rank_pattern", {"q_proj": 2}), ("alpha_pattern", {"up_proj": 24})),
    ),
    "r2-kv": Spec(r=2, alpha=2, std=0.3, targets=("k_proj", "v_proj")),
}
PROMPTS = [[5, 17, 60, 3, 9, 41, 22], [8, 8, 1, 90], [33, 2, 71, 12, 4, 6, 50, 19, 7], [64, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF's tiny Llama, Prism's, the adapters' directories, LoraSlots with them in slots
    0..3 of 4)."""
    hf, ours = tiny_pair()
    dirs = make_adapters(hf, SPECS, tmp_path_factory.mktemp("tiny-adapters"))
    slots = LoraSlots(ours, num_slots=len(SPECS))
    for i, name in enumerate(SPECS):
        slots.assign(i, read_adapter(dirs[name], ours).weights)
    return hf, ours, dirs, slots


@pytest.mark.parametrize("i", range(len(SPECS)), ids=list(SPECS))
def test_logits_equal_peft_merged_at_every_step(tiny, i):
    hf, ours, dirs, slots = tiny
    name, prompt = list(SPECS)[i], PROMPTS[i]
    tokens, logits = greedy(ours, slots, [Request(prompt, i)], NEW_TOKENS)
    ref = merged_logits(hf, dirs[name], prompt + tokens[0])[len(prompt) - 1 : -1]
    assert torch.allclose(logits[0], ref, atol=1e-4, rtol=0), float((logits[0] - ref).abs().max())
    base = merged_logits(hf, None, prompt + tokens[0])[len(prompt) - 1 : -1]
    assert float((base - ref).abs().max()) > 0.1  # the adapter matters


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_other_families_equal_peft_merged(tmp_path, family):
    """q/k norm after the projections (qwen3, gemma3), a qkv bias (qwen2), Gemma's layer."""
    hf = _tiny_hf_model(family)
    config = ModelConfig.from_hf(hf.config)
    ours = get_model_class(config.hf_architecture)(config).eval().requires_grad_(False)
    ours.load_weights(hf.state_dict().items())
    dirs = make_adapters(hf, {"a": Spec(r=4, alpha=8, std=0.2)}, tmp_path)
    slots = LoraSlots(ours, num_slots=1)
    slots.assign(0, read_adapter(dirs["a"], ours).weights)
    prompt = PROMPTS[0]
    tokens, logits = greedy(ours, slots, [Request(prompt, 0)], NEW_TOKENS)
    ref = merged_logits(hf, dirs["a"], prompt + tokens[0])[len(prompt) - 1 : -1]
    assert torch.allclose(logits[0], ref, atol=1e-4, rtol=0), float((logits[0] - ref).abs().max())
    base = merged_logits(hf, None, prompt + tokens[0])[len(prompt) - 1 : -1]
    assert float((base - ref).abs().max()) > 0.1


def test_a_step_mixing_adapters_and_the_base_gives_each_request_its_own_tokens(tiny):
    """Every adapter and the base, some joining late (prefill beside decodes), two requests of
    one adapter apart in the batch (its tokens gathered): each request's logits as alone; the
    base's alone exactly those of the model run without any LoraSlots."""
    _, ours, _, slots = tiny
    requests = [Request(p, i, start=i % 2) for i, p in enumerate(PROMPTS)]
    requests += [Request([7, 7, 3], NO_ADAPTER, start=1), Request([1, 2, 3, 4, 5], 0, start=0)]
    tokens, logits = greedy(ours, slots, requests, NEW_TOKENS)
    for r, got, lg in zip(requests, tokens, logits):
        want, want_logits = greedy(ours, slots, [Request(r.prompt, r.slot)], NEW_TOKENS)
        assert got == want[0]
        assert torch.allclose(lg, want_logits[0], atol=1e-5, rtol=0)
    alone = greedy(ours, slots, [Request([7, 7, 3], NO_ADAPTER)], NEW_TOKENS)
    plain = greedy(ours, None, [Request([7, 7, 3])], NEW_TOKENS)  # no LoraSlots at all
    assert alone[0] == plain[0] and torch.equal(alone[1][0], plain[1][0])


def test_a_step_of_base_tokens_only_has_no_lora_work(tiny):
    _, ours, _, slots = tiny
    cpu = torch.device("cpu")
    assert slots.batch([NO_ADAPTER] * 5, cpu) is None
    batch = slots.batch([NO_ADAPTER, 3, 3], cpu)
    layer = ours.model.layers[0]
    assert batch.touches(layer) and batch.touches(layer.self_attn)
    assert not batch.touches(layer.mlp)  # r2-kv adapts k and v only
    assert batch.token_slots.tolist() == [NO_ADAPTER, 3, 3]


def test_slots_refuse_what_they_cannot_run(tiny):
    _, ours, dirs, slots = tiny
    cpu = torch.device("cpu")
    spare = LoraSlots(ours, num_slots=2)
    with pytest.raises(ValueError, match="slot 1, which holds no adapter"):
        spare.batch([1], cpu)
    with pytest.raises(ValueError, match="slot 5"):
        slots.batch([5], cpu)
    _, shallow = tiny_pair(layers=1)
    with pytest.raises(ValueError, match="modules the base lacks"):
        LoraSlots(shallow, 1).assign(0, slots[0])  # (its layer 1 is not there)
    assert spare.free_slot() == 0
    spare.assign(0, slots[0])
    assert spare.free_slot() == 1
    spare.clear(0)
    assert spare[0] is None


def test_the_adapter_as_read(tiny):
    _, ours, dirs, _ = tiny
    a = read_adapter(dirs["r6-patterns"], ours)
    assert a.name == "r6-patterns" and a.rank == 6
    assert a.targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    qkv = a.weights.modules["model.layers.0.self_attn.qkv_proj"]
    assert qkv.a.shape == (2 + 6 + 6, 64)  # q's rank from rank_pattern
    assert [s.name for s in qkv.shards] == ["q_proj", "k_proj", "v_proj"]
    assert [(s.ranks.start, s.ranks.stop) for s in qkv.shards] == [(0, 2), (2, 8), (8, 14)]
    kv = read_adapter(dirs["r2-kv"], ours)
    assert kv.targets == ("k_proj", "v_proj")
    assert set(kv.weights.modules) == {f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)}
    assert kv.nbytes == sum(t.numel() * 4 for _, t in kv.weights.named_tensors())


def test_a_bin_adapter_reads_as_its_safetensors(tiny, tmp_path):
    hf, ours, dirs, _ = tiny
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(dirs["r4"] / "adapter_config.json", bin_dir)
    from safetensors.torch import load_file

    tensors = load_file(dirs["r4"] / "adapter_model.safetensors")
    torch.save(tensors, bin_dir / "adapter_model.bin")
    a, b = read_adapter(dirs["r4"], ours), read_adapter(bin_dir, ours)
    for (na, ta), (nb, tb) in zip(a.weights.named_tensors(), b.weights.named_tensors()):
        assert na == nb and torch.equal(ta, tb)


def _edited(src, dst, config=None, drop=None):
    """A copy of adapter `src` with its config updated by `config`, `drop` deleted."""
    shutil.copytree(src, dst)
    if config is not None:
        file = dst / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if drop is not None:
        (dst / drop).unlink()
    return dst


BAD = {  # name -> (how the adapter is made, the error's words)
    "missing-config": (dict(drop="adapter_config.json"), "has no adapter_config.json"),
    "missing-weights": (
        dict(drop="adapter_model.safetensors"),
        "has no adapter_model.safetensors or adapter_model.bin",
    ),
    "unknown-target": (
        dict(config={"target_modules": ["q_proj", "qkv_linear"]}),
        "unknown target module 'qkv_linear'",
    ),
    "rank-too-large": (dict(config={"r": 128}), "rank 128 exceeds the maximum rank 64"),
    "dora": (dict(config={"use_dora": True}), r"DoRA \(use_dora\) is not supported"),
    "bias": (dict(config={"bias": "all"}), "bias 'all' is not supported"),
    "modules-to-save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_refused_naming_the_problem(tiny, tmp_path, case):
    _, ours, dirs, _ = tiny
    how, words = BAD[case]
    bad = _edited(dirs["r4"], tmp_path / case, **how)
    with pytest.raises(AdapterError, match=f"adapter {case}: .*{words}"):
        read_adapter(bad, ours)


def test_adapters_peft_makes_that_prism_cannot_run(tmp_path):
    """Real PEFT adapters: on lm_head and embed_tokens (listed, or matched by a regex: then
    the tensors tell), DoRA, rank above the maximum, a bias."""
    hf, ours = tiny_pair()
    cases = {
        "lm-head": Spec(targets=("q_proj", "lm_head")),
        "embed": Spec(targets=("embed_tokens",)),
        "dora": Spec(extra=(("use_dora", True),)),
        "r16": Spec(r=16),
        "bias": Spec(extra=(("bias", "lora_only"),)),
    }
    dirs = make_adapters(hf, cases, tmp_path)
    from peft import LoraConfig, get_peft_model

    # target_modules as a regex: the tensors tell the targets
    regex = get_peft_model(hf, LoraConfig(r=2, target_modules=r".*(q_proj|lm_head)"))
    regex.save_pretrained(tmp_path / "regex")
    regex.unload()
    dirs["regex"] = tmp_path / "regex"
    words = {
        "lm-head": "target module 'lm_head' is not supported",
        "embed": "target module 'embed_tokens' is not supported",
        "regex": "target module 'lm_head' is not supported",
        "dora": r"DoRA \(use_dora\)",
        "r16": "rank 16 exceeds the maximum rank 8",
        "bias": "bias 'lora_only' is not supported",
    }
    for name, path in dirs.items():
        with pytest.raises(AdapterError, match=words[name]):
            read_adapter(path, ours, max_rank=8, name=name)


def test_an_adapter_of_another_base_is_refused(tmp_path):
    wide, _ = tiny_pair(hidden=64)
    _, narrow = tiny_pair(hidden=32)
    dirs = make_adapters(wide, {"wide": Spec()}, tmp_path)
    with pytest.raises(AdapterError, match=r"adapter wide: model\.layers\.0\..* but the base's"):
        read_adapter(dirs["wide"], narrow)
    deep = tmp_path / "deep"  # a layer the base has not
    _edited(dirs["wide"], deep)
    from safetensors.torch import load_file, save_file

    t = load_file(deep / "adapter_model.safetensors")
    t = {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}
    save_file(t, deep / "adapter_model.safetensors")
    _, same = tiny_pair(hidden=64)
    with pytest.raises(AdapterError, match=r"the base has no model\.layers\.7\.mlp\.down_proj"):
        read_adapter(deep, same)
    with pytest.raises(AdapterError, match="is not a directory"):
        read_adapter(tmp_path / "nowhere", same)


def test_a_base_split_over_devices_takes_no_adapter(tiny):
    from models.tensor_parallel import TensorParallel, host_all_reduce

    _, ours, dirs, _ = tiny
    cpu = torch.device("cpu")
    tp = TensorParallel.split(ours, [cpu, cpu], host_all_reduce)
    with pytest.raises(AdapterError, match="adapter r4: .*tensor parallelism"):
        read_adapter(dirs["r4"], tp)


def _random_weights(model, layers, rank: int, std: float, dtype) -> LoraWeights:
    """A rank-`rank` adapter on every projection of `layers` of `model`, N(0, std) entries."""
    g = torch.Generator().manual_seed(3)
    by_module: dict[str, list] = {}
    for t in lora_targets(model).values():
        if int(t.module.split(".")[2]) in layers:
            by_module.setdefault(t.module, []).append(t)
    modules = {}
    for name, ts in by_module.items():
        a = torch.randn(rank * len(ts), ts[0].in_features, generator=g) * std
        shards = tuple(
            LoraShard(
                t.shard,
                t.rows,
                slice(j * rank, (j + 1) * rank),
                (torch.randn(t.out_features, rank, generator=g) * std).to(dtype),
            )
            for j, t in enumerate(ts)
        )
        modules[name] = LoraModule(a.to(dtype), shards)
    return LoraWeights(modules)


@torch.no_grad()
def test_the_fused_decode_program_leaves_a_layer_with_lora_work_to_its_forward():
    """A three-row decode step of the tiny bf16 Llama, an adapter on its second layer: the
    first layer runs as fused small GEMMs, the second as its own forward (projections through
    ctx.linear, deltas added); the output that of the plain forward with the adapter."""
    lm, caches, saved, step, ids, pos, plain = cached_decode_step(3)
    slots = LoraSlots(lm.model, num_slots=2)
    slots.assign(1, _random_weights(lm.model, {1}, 4, 0.5, torch.bfloat16))
    lora = slots.batch([1, NO_ADAPTER, 1], torch.device("cpu"))
    for c, s in zip(caches, saved):
        c.copy_(s)
    want = lm.model(ids, pos, ForwardContext(attn=TorchPagedAttention(caches, step), lora=lora))
    assert float((want.float() - plain.float()).abs().max()) > 0.1  # the adapter matters
    fused_layers = []

    class Counting(fused_decode.StepOps):
        def project(self, linear, x, **kw):
            fused_layers.append(linear)
            return super().project(linear, x, **kw)

    ops = Counting(small=SmallGemmConfig(16, 32))
    for c, s in zip(caches, saved):
        c.copy_(s)
    ctx = ForwardContext(attn=TorchPagedAttention(caches, step), step_ops=ops, lora=lora)
    got = fused_decode.forward(lm.model, ids, pos, ctx, ops)
    first = lm.model.model.layers[0]
    assert fused_layers and all(any(p is m for m in first.modules()) for p in fused_layers)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 2e-2, float(rel)
