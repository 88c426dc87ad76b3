"""LoRA on a GPU: the kernels (models.kernels.triton_lora) against the per-slot torch GEMMs in
bf16 on a layer of Llama-3.1-8B's projection shapes, for decode and prefill groupings of 8 slots
of mixed ranks; the kernels captured in a CUDA graph over a static input refilled between
replays; and a base with 8 adapters whose decode steps mixing them and the base replay decode
graphs with LoRA work, giving the tokens of the eager engine (kernels, and torch GEMMs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from models.layers.merged_linear import MergedLinear
from models.lora import NO_ADAPTER, KernelLoraBatch, LoraAdapter, LoraSlots, LoraWeights
from prism_server.engine.adapters import BaseAdapters
from tests.gpu.common import (
    GPU,
    assert_no_real_divergence,
    cuda_pool,
    greedy,
    model_engine,
    on_gpu,
    prompts,
    tiny_model,
)
from tests.models.lora_cases import random_weights

pytestmark = GPU
N = NO_ADAPTER
CUDA = torch.device("cuda")


class _Layer(nn.Module):
    """A Llama-3.1-8B layer's projections (hidden 4096, 8 KV heads of 128, MLP 14336)."""

    def __init__(self):
        super().__init__()
        attn, mlp = nn.Module(), nn.Module()
        attn.qkv_proj = MergedLinear(4096, {"q_proj": 4096, "k_proj": 1024, "v_proj": 1024})
        attn.o_proj = nn.Linear(4096, 4096, bias=False)
        mlp.gate_up_proj = MergedLinear(4096, {"gate_proj": 14336, "up_proj": 14336})
        mlp.down_proj = nn.Linear(14336, 4096, bias=False)
        self.self_attn, self.mlp = attn, mlp


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# slot -> the adapter's rank per projection: ranks 8 to 64, some shards left alone
RANKS = {
    0: dict.fromkeys(ALL, 16),
    1: {"q_proj": 8, "v_proj": 8},
    2: dict.fromkeys(ALL, 64),
    3: {"k_proj": 32, "v_proj": 32, "o_proj": 32},
    4: {"gate_proj": 8, "up_proj": 16, "down_proj": 32},
    5: dict.fromkeys(ALL, 8),
    6: {"q_proj": 64, "up_proj": 64},
    7: {"q_proj": 4, "k_proj": 8, "v_proj": 16, "o_proj": 4, "down_proj": 64},
}


def _steps() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    decode = (torch.randint(-1, 8, (64,), generator=g)).tolist()  # a token a sequence
    prefill = [2] * 300 + [N] * 40 + [5] * 513 + [0] * 7 + [7] * 129 + [N] + [3] * 64
    return {
        "decode-64": decode,
        "decode-1": [6],
        "decode-13": decode[:13],
        "prefill": prefill,
        "prefill-beside-decodes": [4] * 200 + decode[:32] + [1] * 17,
    }


STEPS = _steps()


@pytest.fixture(scope="module")
def layer():
    """(the layer on the GPU in bf16, its kernels' slots, its torch GEMMs' slots)."""
    base = _Layer().to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ker = LoraSlots(base, num_slots=8, max_rank=64)
    ref = LoraSlots(base, num_slots=8, max_rank=64, kernels=False)
    assert ker.kernels
    for slot, ranks in RANKS.items():
        w = random_weights(base, ranks, g, std=0.05, dtype=torch.bfloat16, device="cuda")
        ker.assign(slot, w)
        ref.assign(slot, w)
    return base, ker, ref


def _close(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> None:
    """Within bf16's rounding of the deltas (the sums' orders differ)."""
    delta = (want.float() - base.float()).abs().max()
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2e-2 * float(delta) + 1e-2, (err, float(delta))


@pytest.mark.parametrize("step", sorted(STEPS))
def test_the_kernels_add_what_the_torch_gemms_add(layer, step):
    base, ker, ref = layer
    token_slots = STEPS[step]
    got, want = ker.batch(token_slots, CUDA), ref.batch(token_slots, CUDA)
    assert isinstance(got, KernelLoraBatch)
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = [i for i, s in enumerate(token_slots) if s == N]
    for name, module in base.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        t = len(token_slots)
        x = torch.randn(t, module.in_features, generator=g, device="cuda").bfloat16()
        y = torch.randn(t, module.out_features, generator=g, device="cuda").bfloat16()
        out = got.add(module, x, y.clone())
        _close(out, want.add(module, x, y.clone()), y)
        assert torch.equal(out[rows], y[rows]), name


def test_the_kernels_replay_in_a_graph_over_a_refilled_input(layer):
    """Each module's shrink and expand captured once for 64 tokens; replays over other steps'
    slots (fewer tokens and tiles, the base's among them) give the torch GEMMs' deltas."""
    base, ker, ref = layer
    graph_input = ker.graph_input(capacity=64)
    steps = (STEPS["decode-64"], STEPS["decode-13"], [N] * 5, [7, 7, 0])
    # the tiles of the step that has the most: the others replay it with tiles idle
    work = graph_input.batch(64, max(graph_input.tiles_for(t, 64) for t in steps))
    modules = [m for m in base.modules() if isinstance(m, nn.Linear)]
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(64, m.in_features, generator=g, device="cuda").bfloat16() for m in modules]
    ys = [torch.randn(64, m.out_features, generator=g, device="cuda").bfloat16() for m in modules]
    outs = [y.clone() for y in ys]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for m, x, o in zip(modules, xs, outs):  # warm-up: the kernels compiled
            work.add(m, x, o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m, x, o in zip(modules, xs, outs):
            work.add(m, x, o)
    for token_slots in steps:
        graph_input.fill(token_slots)
        padded = token_slots + [N] * (64 - len(token_slots))
        for o, y in zip(outs, ys):
            o.copy_(y)
        graph.replay()
        want = ref.batch(padded, CUDA)
        for m, x, y, o in zip(modules, xs, ys, outs):
            expect = y.clone() if want is None else want.add(m, x, y.clone())
            _close(o, expect, y)
    torch.cuda.synchronize()


def _serve_adapters(me, weights: list[LoraWeights], pool, kernels: bool = True) -> list[str]:
    """Loads the adapters into `me` (names <me>-lora<i>), its slots running the kernels or the
    torch GEMMs; -> their names."""
    me.adapters = BaseAdapters(me.runner.model, len(weights), max_rank=64)
    if not kernels:
        me.adapters.slots = LoraSlots(me.runner.model, len(weights), 64, kernels=False)
    me.runner.lora = me.adapters
    names = []
    for i, w in enumerate(weights):
        name = f"{me.name}-lora{i}"
        rank = max(s.ranks.stop - s.ranks.start for m in w.modules.values() for s in m.shards)
        adapter = LoraAdapter(name, Path(name), rank, ALL, w)
        me.adapters.add(adapter, pool, me.device, on_device=True)
        names.append(name)
    return names


def test_a_base_with_8_adapters_replays_mixed_decodes_with_the_eager_tokens():
    """16 requests over 8 adapters and the base in each decode step: the graphed engine
    replays decode graphs with LoRA work (captured at their first use) and gives the tokens of
    the eager engine, whose LoRA work is the same kernels, and of an eager engine whose LoRA
    work is the torch GEMMs."""
    cfg, cpu_model = tiny_model(num_attention_heads=8)
    model = on_gpu(cpu_model)
    pool = cuda_pool(pages=64)
    g = torch.Generator().manual_seed(4)
    weights = [random_weights(model, RANKS[i], g, std=0.05, dtype=torch.bfloat16) for i in range(8)]
    graphed = model_engine("graphed", cfg, model, pool, graphs=True)
    eager = model_engine("eager", cfg, model, pool, graphs=False)
    gemms = model_engine("gemms", cfg, model, pool, graphs=False)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    ps = prompts(16, seed=5)
    results = []
    lora_replays = []
    for me, kernels in ((graphed, True), (eager, True), (gemms, False)):
        names = _serve_adapters(me, weights, pool, kernels)
        adapters = [names[i % 8] if i % 5 != 4 else None for i in range(16)]
        if me is graphed:
            run = me.runner.graphs.run

            def counting(*a, run=run, **k):
                lora_replays.append(len(a) > 4 and a[4] is not None or k.get("lora") is not None)
                return run(*a, **k)

            me.runner.graphs.run = counting
        results.append(greedy(me, ps, 16, adapters))
    assert sum(lora_replays) >= 15  # the decode steps replayed graphs with LoRA work
    sizes = {bs for bs, _ in graphed.runner.graphs.lora_graphs}  # captured at first use only
    assert sizes and sizes <= set(graphed.runner.graphs.batch_sizes)
    (ref_tokens, ref_logits), (tokens, _), (gemm_tokens, _) = results[1], results[0], results[2]
    assert assert_no_real_divergence(ref_tokens, ref_logits, tokens, tie=0.02) >= 12
    assert assert_no_real_divergence(ref_tokens, ref_logits, gemm_tokens, tie=0.05) >= 12
    base_tokens, _ = greedy(eager, ps[:4], 16)  # without adapters: other tokens
    assert base_tokens != ref_tokens[:4]
    for me in (graphed, eager, gemms):
        me.check_integrity()
        me.close()
