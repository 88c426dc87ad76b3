"""CPU decode benchmark: SmolLM2-135M through Prism's engine vs transformers `generate`, same run.

Prints decode tokens/s at batch 1 (goal: not slower than transformers) and aggregate tokens/s with
16 concurrent requests (goal: >= 3x transformers' batch-1 rate).

    .venv/bin/python scripts/bench_cpu.py [--tokens 128] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.embedded import embedded_model_dir  # noqa: E402
from prism_server import envs  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


class HFPeer:
    """transformers `generate` on the same dequantized weights: decode rate at batch 1."""

    def __init__(self, model_dir: Path, prompt_ids: list[int]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.ids = torch.tensor([prompt_ids])

    def _time(self, k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                self.ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - t

    def decode_rate(self, n: int) -> float:
        return (n - 1) / (self._time(n) - self._time(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs; medians reported")
    args = ap.parse_args()
    n, c = args.tokens, args.concurrency

    spec = ModelSpec("smollm2-135m", "smollm2-135m", max_num_seqs=max(c, 1))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ours_b1, ours_agg, hf_b1 = [], [], []
    with Engine(EngineConfig(models=(spec,), device="cpu", enable_prefix_caching=False)) as engine:
        prompt_ids = engine.encode("smollm2-135m", PROMPT)
        prompts = [engine.encode("smollm2-135m", f"{PROMPT} Variation {i}.") for i in range(c)]
        hf = HFPeer(embedded_model_dir("smollm2-135m", envs.gguf_cache_dir()), prompt_ids)
        engine.generate("smollm2-135m", [prompt_ids], SamplingParams(max_tokens=4))  # warm-up
        hf.decode_rate(4)
        for _ in range(args.repeats):  # alternate the two sides so both see the same noise
            one = engine.generate("smollm2-135m", [prompt_ids], params)[0]
            ours_b1.append((len(one.token_ids) - 1) / (one.finish_time - one.first_token_time))
            hf_b1.append(hf.decode_rate(n))
            t = time.perf_counter()
            outs = engine.generate("smollm2-135m", prompts, params)
            ours_agg.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    ob1, oagg, hb1 = (statistics.median(x) for x in (ours_b1, ours_agg, hf_b1))

    print(
        f"# SmolLM2-135M fp32, CPU ({platform.machine()}, {torch.get_num_threads()} threads), "
        f"{len(prompt_ids)}-token prompt, {n} new tokens, median of {args.repeats}"
    )
    print(f"{'measure':<46}{'prism':>9}{'transformers':>14}{'ratio':>8}")
    print(f"{'decode tokens/s, batch 1':<46}{ob1:>9.1f}{hb1:>14.1f}{ob1 / hb1:>8.2f}")
    print(
        f"{f'aggregate tokens/s, {c} concurrent (HF: batch 1)':<46}{oagg:>9.1f}{hb1:>14.1f}"
        f"{oagg / hb1:>8.2f}"
    )
    print("goals: batch-1 ratio >= 1.0, aggregate ratio >= 3.0")


if __name__ == "__main__":
    main()
