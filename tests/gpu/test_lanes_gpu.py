"""Two decode lanes on one GPU: two models' steps at once on two streams, each lane with its own
workspaces, graph pool and capture stream (graphs captured on one stream share one cuBLAS
workspace, a race once two lanes replay at once). The tokens are those of one lane, up to bf16
near-ties (a batch's shape may differ between the two runs). The model is the GPU tests' tiny
Llama, so that XQA builds no kernel module beyond the graph tests' own."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import GPU, TINY, agreeing_prefix
from tests.models.test_loader import _save_hf_dir
from tests.prism_server.test_lanes import serve_both

pytestmark = GPU


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "xqa"])
def test_two_lanes_on_a_gpu_give_one_lanes_tokens(monkeypatch, tmp_path, backend):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(
        tf.LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    )
    path = _save_hf_dir(tmp_path, hf.eval())
    monkeypatch.setenv("PRISM_DECODE_BACKEND", backend)
    kw = dict(source=str(path), block_size=16, device="cuda", kv_budget_bytes=1 << 30)
    one, _, _ = serve_both(1, monkeypatch, **kw)
    two, companions, lanes = serve_both(2, monkeypatch, **kw)
    assert lanes == {"a": 0, "b": 1} and companions > 0
    assert all(len(t) == 24 for t in two.values())
    same = sum(two[k] == one[k] for k in one)
    prefix = [agreeing_prefix(one[k], two[k]) for k in one]
    assert same >= len(one) - 2 and min(prefix) >= 4, (one, two)
