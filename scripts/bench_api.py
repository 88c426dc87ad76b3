"""API features and what they cost or save, each beside its reference measured in the same run:

- prefix caching: time to first token of turn 5 of a 5-turn chat (a ~4k-token history, token-id
  prompts: each turn adds a user message and the previous answer) with the prefix cache and
  without it (two engines, alternating turns of the same conversation);
- structured output: decode TPOT at batch 16 with every row under a JSON-schema grammar vs plain
  sampling, same engine, alternating.

    python3 scripts/bench_api.py [--model dummy:llama-3.1-8b] [--json out.json]

Default model: dummy:llama-3.1-8b on a GPU, dummy:tiny-llama on the CPU (the figures there say
only that the code runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.grammar import GrammarSpec  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

NAME = "m"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "score": {"type": "number"},
    },
    "required": ["name", "tags", "score"],
}


def engine(model: str, device: str, prefix: bool) -> Engine:
    spec = ModelSpec(NAME, model, max_model_len=8192, max_num_batched_tokens=8192)
    # two engines live at once (cached and plain): each gets a pool of its own, a share of the GPU
    budget = 40 << 30 if device == "cuda" else None
    cfg = EngineConfig(
        models=(spec,), device=device, enable_prefix_caching=prefix, pool_budget_bytes=budget
    )
    return Engine(cfg)


def ttft(e: Engine, ids: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    (c,) = e.generate(NAME, [ids], params)
    return c.first_token_time - c.arrival_time, c.token_ids, c.num_cached_tokens


def bench_prefix(model: str, device: str, history: int, turns: int = 5) -> dict:
    """Turn k's prompt: turn k-1's prompt, its answer, and a new user message; the last turn's
    prompt holds about `history` tokens."""
    per_turn = history // turns
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    out: dict = {"turns": []}
    with engine(model, device, True) as cached, engine(model, device, False) as plain:
        vocab = cached.served[NAME].vocab_size
        base = [(7 * i + 3) % (vocab - 10) + 5 for i in range(per_turn * turns + 64 * turns)]
        prompt: list[int] = []
        for k in range(turns):
            prompt = prompt + base[k * per_turn : (k + 1) * per_turn]
            t_c, ans_c, hit = ttft(cached, prompt, params)
            t_p, ans_p, _ = ttft(plain, prompt, params)
            out["turns"].append(
                {
                    "prompt_tokens": len(prompt),
                    "cached_tokens": hit,
                    "ttft_cached_s": t_c,
                    "ttft_plain_s": t_p,
                    "same_answer": ans_c == ans_p,
                }
            )
            prompt = prompt + ans_c
        last = out["turns"][-1]
        out["speedup"] = last["ttft_plain_s"] / last["ttft_cached_s"]
    return out


def decode_tpot(e: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    outs = e.generate(NAME, prompts, params)
    return statistics.median(
        (c.finish_time - c.first_token_time) / max(len(c.token_ids) - 1, 1) for c in outs
    )


def bench_structured(model: str, device: str, batch: int, rounds: int) -> dict:
    with engine(model, device, False) as e:
        served = e.served[NAME]
        grammar = served.compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)))
        vocab = served.vocab_size
        prompts = [[(11 * i + j) % (vocab - 10) + 5 for j in range(1024)] for i in range(batch)]
        plain = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        guided = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, grammar=grammar)
        decode_tpot(e, prompts, plain)  # warm-up (graphs, kernels, the grammar's caches)
        decode_tpot(e, prompts, guided)
        p, g = [], []
        for _ in range(rounds):
            p.append(decode_tpot(e, prompts, plain))
            g.append(decode_tpot(e, prompts, guided))
    tp, tg = statistics.median(p), statistics.median(g)
    return {"batch": batch, "tpot_plain_s": tp, "tpot_grammar_s": tg, "overhead": tg / tp - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--history", type=int, default=None, help="turn 5's prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = args.model or ("dummy:llama-3.1-8b" if gpu else "dummy:tiny-llama")
    history = args.history or (4096 if gpu else 512)
    res = {"model": model, "device": device}
    res["prefix"] = pre = bench_prefix(model, device, history)
    print(f"prefix caching, {model} on {device}: TTFT per turn (cached vs recomputed)")
    for i, t in enumerate(pre["turns"], 1):
        print(
            f"  turn {i}: {t['prompt_tokens']:5d} prompt tokens, {t['cached_tokens']:5d} cached: "
            f"{t['ttft_cached_s'] * 1e3:8.1f} ms vs {t['ttft_plain_s'] * 1e3:8.1f} ms"
            f"{'' if t['same_answer'] else '  (answers differ)'}"
        )
    print(f"  turn 5 TTFT: {pre['speedup']:.1f}x faster with the cache")
    res["structured"] = st = bench_structured(model, device, 16, args.rounds)
    print(
        f"structured output, batch {st['batch']}: TPOT {st['tpot_grammar_s'] * 1e3:.2f} ms with a "
        f"JSON-schema grammar vs {st['tpot_plain_s'] * 1e3:.2f} ms plain "
        f"({st['overhead'] * 100:+.1f}%, target <= +10%)"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
