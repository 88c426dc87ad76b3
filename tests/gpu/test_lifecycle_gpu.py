"""The lifecycle on the GPU: two architectures that cannot both be resident take turns; greedy
tokens after every reactivation equal those before the first eviction, with CUDA graphs on, and
nothing is captured again after start-up."""

from __future__ import annotations

import pytest
import torch

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.cuda_graph_runner import CudaGraphRunner
from prism_server.engine.engine import Engine
from prism_server.engine.memory_budget import weight_pool_bytes
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU

pytestmark = GPU
GiB = 1 << 30


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(300, 30000, (n,), generator=g).tolist()


@pytest.mark.parametrize(
    "presets, cycles",
    [
        (("llama-3.2-3b", "qwen2.5-7b"), 100),
        (("llama-3.2-1b", "gemma-3-1b"), 1000),  # small models: 1,000 cycles in ~2 minutes
    ],
    ids=["3b-7b", "1b-gemma-1000"],
)
def test_greedy_tokens_survive_eviction_for_two_architectures(monkeypatch, presets, cycles):
    captures = {"n": 0}
    original = CudaGraphRunner.capture

    def counting(self):
        captures["n"] += 1
        return original(self)

    monkeypatch.setattr(CudaGraphRunner, "capture", counting)
    llama = ModelSpec("llama", f"dummy:{presets[0]}", max_model_len=1024, max_num_seqs=8)
    qwen = ModelSpec("qwen", f"dummy:{presets[1]}", max_model_len=1024, max_num_seqs=8)
    dev = torch.device("cuda")
    page = 128 << 20
    small, big = sorted(weight_pool_bytes(m, dev, page) for m in (llama, qwen))
    budget = big + min(small - 2 * page, 4 * GiB)  # one of the two at a time, and KV
    # no prefix cache: a repeated prompt is computed again, in the batch shape of its reference
    cfg = EngineConfig(
        models=(llama, qwen), device="cuda", pool_budget_bytes=budget, enable_prefix_caching=False
    )
    with Engine(cfg) as e:
        at_start = captures["n"]
        assert at_start == 2  # one runner each, captured once at load
        snap = {m.name: m.residency.value for m in e.worker.snapshot_now().models}
        assert snap == {"llama": "resident", "qwen": "offloaded"}
        for m in e.worker.models.values():
            assert m.runner.graphs is not None and m.runner.graphs.graphs
        prompts = [prompt(200 + 37 * i, i) for i in range(4)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        # references: the same batches the cycles run (bf16 results depend on the batch shape)
        ref, ref_short = {}, {}
        for n in ("llama", "qwen"):
            ref[n] = [c.token_ids for c in e.generate(n, prompts, params)]
            ref_short[n] = [c.token_ids for c in e.generate(n, prompts[:2], short)]
        assert ref["llama"] != ref["qwen"]
        for i in range(cycles):
            name = ("llama", "qwen")[i % 2]
            got = [c.token_ids for c in e.generate(name, prompts[:2], short)]
            assert got == ref_short[name], (i, name)
        for name in ("llama", "qwen"):  # and the long answers, once more
            assert [c.token_ids for c in e.generate(name, prompts, params)] == ref[name]
        snap = {m.name: m for m in e.worker.snapshot_now().models}
        assert snap["llama"].activations + snap["qwen"].activations >= cycles
        assert captures["n"] == at_start  # graphs survive eviction: never recaptured
        e.check_integrity()
