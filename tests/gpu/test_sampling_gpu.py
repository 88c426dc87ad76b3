"""FlashInfer's top-k/top-p kernel behind the batched sampler, on CUDA: each row's draws follow
the row's own filtered distribution (the same reference as the CPU test), and top-k 1 is the
argmax."""

from __future__ import annotations

import torch

from prism_server.engine.sampler import sample_batch
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU
from tests.prism_server.test_sampler import draws_follow_each_rows_distribution

pytestmark = GPU


def test_the_kernel_draws_each_rows_filtered_distribution():
    draws_follow_each_rows_distribution("cuda")


def test_top_k_one_on_a_large_vocabulary_is_the_argmax():
    x = torch.randn(64, 128256, device="cuda") * 4
    params = [SamplingParams(temperature=0.9, top_k=1, top_p=0.9)] * 64
    assert torch.equal(sample_batch(x, params), x.argmax(dim=-1))
