"""CPU decode benchmark: SmolLM2-135M through Prism's engine vs transformers `generate`, same run.

Prints decode tokens/s at batch 1 (goal: not slower than transformers) and aggregate tokens/s with
16 concurrent requests (goal: >= 3x transformers' batch-1 rate).

    .venv/bin/python scripts/bench_cpu.py [--tokens 128] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.embedded import embedded_model_dir  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def hf_decode_rate(model_dir: Path, prompt_ids: list[int], n: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])

    def run(k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    run(4)  # warm-up
    return (n - 1) / (run(n) - run(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    n, c = args.tokens, args.concurrency

    spec = ModelSpec("smollm2-135m", "smollm2-135m", max_num_seqs=max(c, 1))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    with Engine(EngineConfig(models=(spec,), device="cpu")) as engine:
        prompt_ids = engine.encode("smollm2-135m", PROMPT)
        engine.generate("smollm2-135m", [prompt_ids], SamplingParams(max_tokens=4))  # warm-up
        one = engine.generate("smollm2-135m", [prompt_ids], params)[0]
        ours_b1 = (len(one.token_ids) - 1) / (one.finish_time - one.first_token_time)
        prompts = [engine.encode("smollm2-135m", f"{PROMPT} Variation {i}.") for i in range(c)]
        t = time.perf_counter()
        outs = engine.generate("smollm2-135m", prompts, params)
        wall = time.perf_counter() - t
        ours_agg = sum(len(o.token_ids) for o in outs) / wall
    hf_b1 = hf_decode_rate(embedded_model_dir("smollm2-135m"), prompt_ids, n)

    print(f"# SmolLM2-135M fp32, CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), {len(prompt_ids)}-token prompt, {n} new tokens")
    print(f"{'measure':<42}{'prism':>10}{'transformers':>14}{'ratio':>8}")
    print(f"{'decode tokens/s, batch 1':<42}{ours_b1:>10.1f}{hf_b1:>14.1f}{ours_b1 / hf_b1:>8.2f}")
    print(f"{f'aggregate tokens/s, {c} concurrent (vs HF b1)':<42}{ours_agg:>10.1f}{hf_b1:>14.1f}"
          f"{ours_agg / hf_b1:>8.2f}")
    print("goals: batch-1 ratio >= 1.0, aggregate ratio >= 3.0")


if __name__ == "__main__":
    main()
