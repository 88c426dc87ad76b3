"""Load test of the OpenAI server: N concurrent streaming clients against the embedded models.

Prints requests/s, output tokens/s and p50/p99 TTFT per concurrency level, with the single-client
run (no batching possible) measured in the same run as the reference.

    .venv/bin/python scripts/bench_load.py [--url URL] [--concurrency 1,8,32] [--requests 48]

Without --url it starts a server in-process on the CPU (both embedded models).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = ("smollm2-135m", "gemma3-270m")
TOPICS = ["rivers", "owls", "glass", "comets", "tea", "maps", "bridges", "snow"]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int):
    model = MODELS[i % len(MODELS)]
    body = {
        "model": model,
        "prompt": f"A few facts about {TOPICS[i % len(TOPICS)]}:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                ttft = ttft or time.perf_counter() - t0
            elif line.startswith(b"data: [DONE]"):
                break
    tokens = max_tokens
    return ttft, tokens, time.perf_counter() - t0


async def level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def run(i):
            async with sem:
                return await one(session, url, i, max_tokens)

        t = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - t
    ttfts = [r[0] for r in results]
    return {
        "concurrency": concurrency,
        "rps": requests / wall,
        "tok_s": sum(r[1] for r in results) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": pct(ttfts, 99),
    }


def start_local():
    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.engine import Engine
    from prism_server.serving.app import serve_in_thread

    engine = Engine(EngineConfig(models=tuple(ModelSpec(m, m) for m in MODELS), device="cpu"))
    return serve_in_thread(engine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    local = None if args.url else start_local()
    url = args.url or local.url
    levels = [int(c) for c in args.concurrency.split(",")]
    asyncio.run(level(url, 2, 4, 4))  # warm-up
    rows = []
    for c in levels:
        n = args.requests if c > 1 else max(4, args.requests // 8)
        rows.append(asyncio.run(level(url, c, n, args.max_tokens)))
    base = rows[0]
    print(
        f"# {url}: streaming /v1/completions alternating {', '.join(MODELS)}, "
        f"{args.max_tokens} tokens each"
    )
    print(
        f"{'clients':>8}{'req/s':>9}{'tok/s':>9}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
        f"{'tok/s vs ' + str(base['concurrency']) + ' client':>20}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>8}{r['rps']:>9.2f}{r['tok_s']:>9.1f}"
            f"{1000 * r['ttft_p50']:>13.0f}{1000 * r['ttft_p99']:>13.0f}"
            f"{r['tok_s'] / base['tok_s']:>19.2f}x"
        )
    print(json.dumps(rows))
    if local is not None:
        local.close()


if __name__ == "__main__":
    main()
