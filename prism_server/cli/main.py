"""Command line: `python -m prism_server [serve] ...`, `python -m prism_server generate ...`,
`python -m prism_server bench ...`, `python -m prism_server status ...` and
`python -m prism_server make-adapters ...`."""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import time

from models.embedded import EMBEDDED_MODELS
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.engine.gpu_setup import MissingPackage
from prism_server.served_model import RequestRejected, ServedModel
from scheduler.sampling_params import SamplingParams


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a TOML file (see README); flags override it")
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME=SOURCE[,KEY=VALUE...]",
        help="a model to serve (repeatable); SOURCE is an embedded model, a .gguf "
        "file, an HF directory or dummy:<preset>; then any model settings, e.g. "
        ",quantization=fp8; a LoRA adapter: NAME,base=MODEL,adapter=DIR. Default: the "
        "embedded models",
    )
    p.add_argument(
        "--lora-dir",
        action="append",
        dest="lora_dirs",
        metavar="DIR",
        help="a directory of LoRA adapters (repeatable): a request naming <DIR>/<name> loads it",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--api-key", help="require Authorization: Bearer <key>")
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--policy",
        choices=["prism", "static", "swap"],
        help="prism (default), or a baseline: static partitions, or whole-model swapping",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        dest="cors_origins",
        metavar="ORIGIN",
        help="a browser origin allowed to call the API, e.g. http://localhost:3000 (repeatable; "
        "* for any). Default: none",
    )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_const",
        const=False,
        help="no line per request in the log",
    )
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON")
    p.add_argument(
        "--enforce-eager",
        action="store_const",
        const=True,
        help="every step eager: no CUDA graphs, no decode step launched ahead",
    )
    p.add_argument(
        "--step-trace",
        metavar="PATH",
        help="write one JSON line per step to PATH.<device> (a scheduling diagnostic)",
    )
    p.add_argument(
        "--request-log",
        metavar="PATH",
        help="append one JSON line per request to PATH as it ends: its response id, tokens, "
        "TTFT, where its time went, its preemptions",
    )
    p.add_argument(
        "--slo-file",
        help="per-model TTFT / TPOT SLOs, JSON {model: {ttft_s, tpot_s}} (as `bench standalone` "
        "writes them), over the config's",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prism_server", description="Prism: many LLMs on few GPUs, one OpenAI API."
    )
    _serve_flags(p)
    sub = p.add_subparsers(dest="command")
    _serve_flags(sub.add_parser("serve", help="serve the OpenAI API (the default command)"))
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
    g.add_argument("--quantization", choices=["fp8"], help="the projections' weights in FP8 (E4M3)")
    a = sub.add_parser(
        "make-adapters", help="write synthetic LoRA adapters of a dummy base (for benchmarks)"
    )
    a.add_argument("--preset", required=True, help="the base's preset (dummy:<preset>)")
    a.add_argument("--names", required=True, help="e.g. ft000,ft001 or 'ft{000..099}'")
    a.add_argument("--rank", type=int, default=16)
    a.add_argument("--seed", type=int, default=0, help="the first adapter's (then +1 each)")
    a.add_argument("--out", required=True, help="the directory of the adapters' directories")
    from prism_server.bench.__main__ import add_arguments

    add_arguments(sub.add_parser("bench", help="replay a workload against a running server"))
    from prism_server.cli import status

    status.add_arguments(
        sub.add_parser("status", help="a running server's models, memory and SLOs, in a terminal")
    )
    return p


def _prompt_ids(served: ServedModel, prompt: str, raw: bool) -> list[int]:
    if raw or not served.has_chat_template:
        return served.encode(prompt)
    return served.encode_chat([{"role": "user", "content": prompt}])


def generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        spec = ModelSpec(
            name=args.model, source=args.model, dtype=args.dtype, quantization=args.quantization
        )
        engine = Engine(EngineConfig(models=(spec,), device=args.device))
    except (ValueError, FileNotFoundError, MissingPackage) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with engine:
        served = engine.model(args.model)
        outs: queue.SimpleQueue = queue.SimpleQueue()
        try:
            ids = _prompt_ids(served, args.prompt, args.raw)
            served.check(len(ids), params.max_tokens)
        except RequestRejected as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        c = Completion(ids, arrival_time=time.monotonic())
        engine.submit(served, ids, params, sink=outs.put, arrival_time=c.arrival_time)
        while not c.finished:
            out = outs.get()
            c.add(out, time.monotonic())
            print(out.new_text, end="", flush=True)
        print()
        if c.error:
            print(f"error: {c.error}", file=sys.stderr)
            return 1
        n, start, first, end = len(c.token_ids), c.arrival_time, c.first_token_time, c.finish_time
        decode = (n - 1) / (end - first) if n > 1 and end > first else float("nan")
        print(
            f"[{args.model} on {engine.device}: {len(ids)} prompt tokens, {n} generated "
            f"({c.finish_reason.value}); first token {1000 * (first - start):.0f} ms, "
            f"decode {decode:.1f} tokens/s, overall {n / (end - start):.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def serve(args: argparse.Namespace) -> int:
    from prism_server import logs
    from prism_server.server_args import ConfigError, check_listen, load_server_args
    from prism_server.serving.app import serve as serve_app

    logs.configure(args.log_format or "text")
    try:
        sargs = load_server_args(
            args.config,
            args.models,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            cors_origins=tuple(args.cors_origins) if args.cors_origins else None,
            access_log=args.access_log,
            log_format=args.log_format,
            request_log=args.request_log,
        )
        logs.configure(sargs.log_format)
        from dataclasses import replace

        from prism_server.server_args import apply_slo_file

        if args.slo_file:
            sargs = apply_slo_file(sargs, args.slo_file)
        for field in ("device", "policy", "enforce_eager", "step_trace"):
            if getattr(args, field):
                eng = replace(sargs.engine, **{field: getattr(args, field)})
                sargs = replace(sargs, engine=eng)
        if args.lora_dirs:
            eng = replace(sargs.engine, lora_dirs=tuple(args.lora_dirs))
            sargs = replace(sargs, engine=eng)
        check_listen(sargs)
        engine = Engine(sargs.engine, strict=False)  # a broken model must not stop the rest
    except (ConfigError, ValueError, FileNotFoundError, MissingPackage) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        url = f"http://{sargs.host}:{port}"
        ok = [s for s in engine.served.values() if not s.failed]
        for s in engine.served.values():
            if s.failed:
                print(f"Model {s.name} failed to load and answers 503: {s.error}", flush=True)
        if not ok:
            print(f"No model could be loaded; Prism answers at {url} with errors.", flush=True)
            return
        first = ok[0].name
        names = ", ".join(s.name for s in ok)
        print(f"Prism serves {names} on {engine.device} at {url}", flush=True)
        if ok[0].has_chat_template:
            body = (
                f'{{"model": "{first}", "messages": [{{"role": "user", "content": '
                f'"What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'
            )
            path = "/v1/chat/completions"
        else:
            body = (
                f'{{"model": "{first}", "prompt": "The capital of France is", '
                f'"max_tokens": 16, "temperature": 0}}'
            )
            path = "/v1/completions"
        auth = f" -H 'Authorization: Bearer {sargs.api_key}'" if sargs.api_key else ""
        print(
            f"Try: curl {url}{path} -H 'Content-Type: application/json'{auth} -d '{body}'",
            flush=True,
        )

    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover (uvloop is a dependency where it exists)
        run = asyncio.run
    try:
        run(serve_app(engine, sargs, ready))
    finally:
        engine.close()
    return 0


def make_adapters(args: argparse.Namespace) -> int:
    from models.lora.synthetic import names_arg, write_adapters
    from models.presets import PRESETS

    if args.preset not in PRESETS:
        print(f"error: no preset {args.preset!r} (presets: {', '.join(PRESETS)})", file=sys.stderr)
        return 2
    try:
        names = names_arg(args.names)
        t = time.perf_counter()
        dirs = write_adapters(args.out, args.preset, names, args.rank, args.seed)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(dirs)} adapters of rank {args.rank} in {args.out} ({time.perf_counter() - t:.1f} s)"
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; serve's flags may come before `serve` and after it alike (both
    count: the command word only says which command), another command's only after it."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.command == "serve":
        i = given.index("serve")
        args = parser.parse_args(given[:i] + given[i + 1 :])
    elif args.command is not None and given[0] != args.command:
        parser.error(f"the flags before `{args.command}` are serve's; give its own after it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "generate":
        return generate(args)
    if args.command == "bench":
        from prism_server.bench.__main__ import run

        return run(args)
    if args.command == "make-adapters":
        return make_adapters(args)
    if args.command == "status":
        from prism_server.cli import status

        return status.run(args)
    return serve(args)
