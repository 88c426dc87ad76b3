"""Command line: `python -m prism_server generate ...`."""

from __future__ import annotations

import argparse
import queue
import sys
import time

from models.embedded import EMBEDDED_MODELS
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine import Engine
from prism_server.sampling_params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prism_server", description="Prism: many LLMs on few GPUs."
    )
    sub = p.add_subparsers(dest="command")
    g = sub.add_parser("generate", help="generate text from one prompt and print the speed")
    g.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"an embedded model ({', '.join(EMBEDDED_MODELS)}), a .gguf file, an HF "
        "directory, or dummy:<preset>",
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--dtype", default="auto")
    return p


def _prompt_ids(engine: Engine, model: str, prompt: str, raw: bool) -> list[int]:
    tok = engine.model(model).tokenizer
    if raw or not getattr(tok, "chat_template", None):
        return engine.encode(model, prompt)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        spec = ModelSpec(name=args.model, source=args.model, dtype=args.dtype)
        engine = Engine(EngineConfig(models=(spec,), device=args.device))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with engine:
        ids = _prompt_ids(engine, args.model, args.prompt, args.raw)
        outs: queue.SimpleQueue = queue.SimpleQueue()
        start = time.monotonic()
        try:
            engine.add_request(args.model, ids, params, sink=outs.put)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        first = None
        n = 0
        while True:
            out = outs.get()
            if out.new_token_ids and first is None:
                first = time.monotonic()
            n += len(out.new_token_ids)
            print(out.new_text, end="", flush=True)
            if out.finished:
                break
        end = time.monotonic()
        print()
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            return 1
        decode = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
        print(
            f"[{args.model} on {engine.device}: {len(ids)} prompt tokens, {n} generated "
            f"({out.finish_reason.value}); first token {1000 * (first - start):.0f} ms, "
            f"decode {decode:.1f} tokens/s, overall {n / (end - start):.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        return generate(args)
    _parser().print_help()
    return 0
