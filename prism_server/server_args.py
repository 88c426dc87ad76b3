"""Server arguments (they contain the engine config, which contains the model specs), from a TOML
file and command-line flags. A bad value gives a message naming the field."""

from __future__ import annotations

import json
import re
import socket
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import ConfigDict, TypeAdapter, ValidationError

from prism_server.config import EngineConfig, ModelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_MODELS = (
    ModelSpec(name="smollm2-135m", source="smollm2-135m"),
    ModelSpec(name="gemma3-270m", source="gemma3-270m"),
)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerArgs:
    __pydantic_config__ = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int = 1024  # accepted but not started, all models; beyond it: 503
    max_request_bytes: int = 8 << 20
    shutdown_timeout_s: float = 60.0  # how long SIGTERM waits for in-flight requests
    # Host header names answered; None: loopback names on a loopback bind, any name otherwise;
    # ["*"]: any name. Stops DNS rebinding of a server on localhost.
    allowed_hosts: tuple[str, ...] | None = None
    # browser origins allowed to call the API (CORS; "*": any); none by default
    cors_origins: tuple[str, ...] = ()
    access_log: bool = True  # one line per request: method, path, status, model, tokens, time
    log_format: str = "text"  # or "json": one object per line
    # a file that gets one JSON line per request as it ends: its response id, tokens, TTFT,
    # where its time went, its preemptions (docs/API.md); None: no request log
    request_log: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be positive")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError("shutdown_timeout_s must not be negative")
        if self.allowed_hosts is not None and any(not h for h in self.allowed_hosts):
            raise ValueError("allowed_hosts must not hold empty names")
        if any(not o for o in self.cors_origins):
            raise ValueError("cors_origins must not hold empty origins")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.request_log is not None and not self.request_log:
            raise ValueError("request_log must be a file path")

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        return self.engine.models


_ADAPTER = TypeAdapter(ServerArgs)


def _explain(e: ValidationError, origin: str) -> ConfigError:
    lines = []
    for err in e.errors():
        loc = ""
        for part in err["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return ConfigError(f"{origin}: " + "; ".join(lines))


_OPTION = re.compile(r"[a-z_]+=")  # a model setting after the source: ,key=value


def parse_model_flag(flag: str) -> dict:
    """`name=source` or just `source` (the name is then the source's), then any model settings
    as `,key=value` (e.g. `llama=/ckpt/llama,quantization=fp8`; the values are checked as a
    config file's); a LoRA adapter is `name,base=model,adapter=dir`."""
    parts = flag.split(",")
    cut = len(parts)
    while cut > 1 and _OPTION.match(parts[cut - 1]):  # a comma inside a path stays in it
        cut -= 1
    head = ",".join(parts[:cut])
    options = dict(p.split("=", 1) for p in parts[cut:])
    for key in ("name", "source"):
        if key in options:
            raise ConfigError(f"--model {flag!r}: {key} is given as NAME=SOURCE, not ,{key}=")
    name, sep, source = head.partition("=")
    if not sep and "adapter" in options:  # a LoRA adapter: NAME,base=MODEL,adapter=DIR
        return {"name": head, **options}
    if not sep:
        name = Path(head).stem if "/" in head or head.endswith(".gguf") else head
        return {"name": name, "source": head, **options}
    if not name or not source:
        raise ConfigError(f"--model {flag!r}: expected NAME=SOURCE[,KEY=VALUE...]")
    return {"name": name, "source": source, **options}


def _read(path: str, origin: str, loads, decode_error: type[Exception], kind: str):
    """The parsed contents of a file; a ConfigError naming `origin` if it is missing or bad."""
    try:
        return loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{origin}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{origin}: a directory, not a file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{origin}: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{origin}: cannot be read: {e.strerror or e}") from None
    except decode_error as e:
        raise ConfigError(f"{origin}: not valid {kind}: {e}") from None


def load_server_args(
    config_path: str | None = None, models: list[str] | None = None, **overrides
) -> ServerArgs:
    """The config file (if any), then flags; no models anywhere = the embedded defaults."""
    data: dict = {}
    origin = "flags"
    if config_path:
        origin = f"config {config_path}"
        data = _read(config_path, origin, tomllib.loads, tomllib.TOMLDecodeError, "TOML")
        if "models" in data:  # top-level [[models]] is accepted as a shortcut for engine.models
            data.setdefault("engine", {})
            if not isinstance(data["engine"], dict):
                raise ConfigError(f"{origin}: engine must be a table")
            if "models" in data["engine"]:
                raise ConfigError(f"{origin}: give the models as [[models]] or [[engine.models]]")
            data["engine"]["models"] = data.pop("models")
        engine = data.get("engine")
        if isinstance(engine, dict) and engine.get("models") == []:
            raise ConfigError(f"{origin}: models is empty (leave it out to serve the defaults)")
    for k, v in overrides.items():
        if v is not None:
            data[k] = v
    if models:
        data.setdefault("engine", {})["models"] = [parse_model_flag(m) for m in models]
    try:
        args = _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise _explain(e, origin) from None
    if not args.models:
        args = replace(args, engine=replace(args.engine, models=DEFAULT_MODELS))
    return args


def check_listen(args: ServerArgs) -> None:
    """That the server can listen where it is told to and write its request log, before the
    models load (ConfigError otherwise)."""
    where = f"{args.host}:{args.port}"
    try:
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((args.host, args.port), family=family):
            pass
    except OSError as e:
        raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from None
    if args.request_log:
        try:
            with open(args.request_log, "a"):
                pass
        except OSError as e:
            raise ConfigError(f"request_log {args.request_log}: {e.strerror or e}") from None


def apply_slo_file(args: ServerArgs, path: str) -> ServerArgs:
    """Per-model SLOs from a JSON file, `{model: {"ttft_s", "tpot_s"}}` (or that under "slos",
    as `bench standalone --out` and a sweep write them), over the config's. A model the config
    does not serve is an error."""
    data = _read(path, f"--slo-file {path}", json.loads, json.JSONDecodeError, "JSON")
    data = data.get("slos", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ConfigError(f"--slo-file {path}: expected an object of model -> SLOs")
    names = {m.name for m in args.models}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"--slo-file {path}: no such models {unknown}")
    models = []
    for m in args.models:
        slo = data.get(m.name)
        if slo is None:
            models.append(m)
            continue
        try:
            ttft, tpot = float(slo["ttft_s"]), float(slo["tpot_s"])
            models.append(replace(m, ttft_slo_ms=1e3 * ttft, tpot_slo_ms=1e3 * tpot))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"--slo-file {path}: {m.name} needs positive ttft_s and tpot_s ({e})"
            ) from None
    return replace(args, engine=replace(args.engine, models=tuple(models)))
