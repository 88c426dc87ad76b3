"""Launch ahead on the GPU: decode steps replayed from the last step's tokens still on the
device (graphs, the pinned copy back, the staged plan) give the tokens (and logprobs) of steps
that read them first, and an EOS in the unread token ends its request with exact KV accounting."""

from __future__ import annotations

import torch

from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU, cuda_pool, model_engine, on_gpu, prompts, tiny_model
from tests.prism_server.test_launch_ahead import both, eos_in_the_unread_token

pytestmark = GPU


def gpu_worker():
    cfg, model = tiny_model()
    return model_engine("m", cfg, on_gpu(model), cuda_pool(pages=8))


def test_a_batch_launched_ahead_replays_graphs_with_the_same_tokens():
    counts = {}

    def setup(run):
        replays = [0]
        graph_run = run.me.runner.graphs.run

        def counting(*a, **k):
            replays[0] += 1
            return graph_run(*a, **k)

        run.me.runner.graphs.run = counting
        counts[run.me.launch_ahead] = replays
        for i, p in enumerate(prompts(6, seed=3)):
            n = 24 - 3 * i  # they end one after another: the batch shrinks as steps run ahead
            run.submit(
                f"g{i}", SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), prompt=p
            )
        run.submit("s", SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5))
        lp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
        run.submit("l", lp)  # its logprobs copied back with the tokens

    plain, ahead = both(setup, make=gpu_worker)
    assert ahead.ahead_steps >= 18
    assert counts[True][0] >= 18 and counts[False][0] >= 18  # decode steps replayed graphs
    torch.cuda.synchronize()


def test_eos_in_the_unread_token_on_the_gpu():
    eos_in_the_unread_token(make=gpu_worker)
