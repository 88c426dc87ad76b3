"""The fleet as a server reports it, and configs that serve part of it: the static policy on the
largest subset of the fleet that fits its pool, and the capacity sweep's first n models.

A derived config is the given TOML with its `[[models]]` tables filtered (config order kept) and
everything else as it was; a config that sizes its pool by `kv_budget_bytes` (the KV room beside
the weights of every configured model) gets the full fleet's pool as `pool_budget_bytes`
instead, so that a subset runs on the same pool as the whole fleet.

The sizes come from a server of the full config (`GET /v1/status`), not from the model shapes:
each model's weight bytes (its packed pool bytes while resident), its KV block bytes, and the
pool's capacity and page size. Nothing here imports the engine.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from prism_server.bench.workload import Row

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_BLOCK_SIZE = 16  # a model table without block_size: the server's default (tokens)


# ---- TOML ----------------------------------------------------------------------------------------
def read_toml(path: str | Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None


def _key(k: str) -> str:
    bare = k and all(c.isalnum() or c in "-_" for c in k)
    return k if bare else _value(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        out = ['"']
        for c in v:
            if c in '"\\':
                out.append("\\" + c)
            elif ord(c) < 0x20 or ord(c) == 0x7F:
                out.append(f"\\u{ord(c):04x}")
            else:
                out.append(c)
        return "".join(out) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise ValueError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _is_tables(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(path: list[str], data: dict, out: list[str], header: str | None) -> None:
    """Writes data's plain values under its header ("[" a table, "[[" an item of an array of
    tables, None the top level), then its sub-tables and arrays of tables."""
    plain = {k: v for k, v in data.items() if not isinstance(v, dict) and not _is_tables(v)}
    dotted = ".".join(_key(p) for p in path)
    if header == "[[":
        out.append(f"\n[[{dotted}]]")
    elif header == "[" and (plain or not data):
        out.append(f"\n[{dotted}]")
    out += [f"{_key(k)} = {_value(v)}" for k, v in plain.items()]
    for k, v in data.items():
        if isinstance(v, dict):
            _table([*path, k], v, out, "[")
        elif _is_tables(v):
            for item in v:
                _table([*path, k], item, out, "[[")


def dumps_toml(data: dict) -> str:
    """TOML for what tomllib reads: tables, arrays of tables, scalars, arrays, inline tables
    (no dates: a server config has none)."""
    out: list[str] = []
    _table([], data, out, None)
    return "\n".join(out).lstrip("\n") + "\n"


# ---- derived configs -----------------------------------------------------------------------------
def config_models(data: dict) -> list[dict]:
    """The config's model tables, top-level `[[models]]` or `engine.models`, in config order."""
    models = data.get("models")
    if models is None:
        models = (data.get("engine") or {}).get("models")
    if not models:
        raise ValueError("the config names no models ([[models]] tables)")
    return list(models)


def model_names(path: str | Path) -> list[str]:
    return [m["name"] for m in config_models(read_toml(path))]


def block_sizes(path: str | Path) -> dict[str, int]:
    """Tokens per KV block of each model of the config."""
    return {
        m["name"]: int(m.get("block_size", DEFAULT_BLOCK_SIZE))
        for m in config_models(read_toml(path))
    }


def kv_budget_set(path: str | Path) -> bool:
    return (read_toml(path).get("engine") or {}).get("kv_budget_bytes") is not None


def derive_config(
    src: str | Path, models: Sequence[str], dst: str | Path, pool_bytes: int | None = None
) -> Path:
    """Writes src with only `models` (kept in config order) to dst. A `kv_budget_bytes` in src
    becomes `pool_budget_bytes = pool_bytes` (the full fleet's pool); without pool_bytes such a
    config is an error (the subset would get a smaller pool)."""
    data = read_toml(src)
    tables = config_models(data)
    names = [m["name"] for m in tables]
    unknown = sorted(set(models) - set(names))
    if unknown:
        raise ValueError(f"{src}: no such models {unknown} (it has {names})")
    if not models:
        raise ValueError("a derived config needs at least one model")
    kept = [m for m in tables if m["name"] in set(models)]
    if "models" in data:
        data["models"] = kept
    else:
        data["engine"]["models"] = kept
    engine = data.get("engine") or {}
    if engine.get("kv_budget_bytes") is not None:
        if pool_bytes is None:
            raise ValueError(
                f"{src} sizes its pool by kv_budget_bytes (beside the weights of every model): "
                "a subset would run on a smaller pool; set pool_budget_bytes"
            )
        del engine["kv_budget_bytes"]
        engine["pool_budget_bytes"] = int(pool_bytes)
    dst = Path(dst)
    dst.write_text(dumps_toml(data))
    return dst


def rows_of(rows: Sequence[Row], models: Sequence[str]) -> list[Row]:
    """The workload rows of `models`, each model's own stream unchanged (arrival times kept)."""
    keep = set(models)
    return [r for r in rows if r.model in keep]


# ---- what the server reports ---------------------------------------------------------------------
def fleet_of(status: Mapping[str, Any]) -> dict:
    """The pool and each model's sizes from a `GET /v1/status` answer (one device)."""
    devices = status["devices"]
    if len(devices) != 1:
        raise ValueError(f"the subset is sized for one device; the server has {len(devices)}")
    (dev,) = devices
    pool = dev["pool"]
    return {
        "page_bytes": pool["page_bytes"],
        "pool_bytes": pool["capacity_bytes"],
        "models": {
            m["name"]: {
                "weight_bytes": m["weight_bytes"],
                "weight_pool_bytes": m.get("weight_pool_bytes") or 0,
                "kv_block_bytes": m["kv_block_bytes"],
            }
            for m in dev["models"]
        },
        # LoRA adapters: served only with their base, in its steps; their own pages each
        "adapters": {
            a["name"]: {"base": m["name"], "weight_bytes": a["weight_bytes"]}
            for m in dev["models"]
            for a in m.get("adapters", ())
        },
    }


async def fetch_fleet(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.get(url + "/v1/status", headers=headers) as r,
    ):
        r.raise_for_status()
        return fleet_of(await r.json())


# ---- the subset that fits ------------------------------------------------------------------------
def weight_pages(fleet: Mapping[str, Any], model: str) -> int:
    """Pool pages the model's weights take: its packed size while resident, else its bytes in
    whole pages."""
    m = fleet["models"][model]
    nbytes = max(m["weight_pool_bytes"], m["weight_bytes"])
    return -(-nbytes // fleet["page_bytes"])


def min_kv_pages(fleet: Mapping[str, Any], model: str, rows: Sequence[Row], block_size: int) -> int:
    """The model's minimal KV: pages for its longest request of the workload (prompt and output),
    at least one page."""
    longest = max((r.prompt_len + r.output_len for r in rows if r.model == model), default=1)
    blocks = -(-longest // block_size)
    nbytes = blocks * fleet["models"][model]["kv_block_bytes"]
    return max(1, -(-nbytes // fleet["page_bytes"]))


def fits(
    fleet: Mapping[str, Any],
    models: Sequence[str],
    min_kv: Mapping[str, int],
    extra: Mapping[str, int] | None = None,
) -> bool:
    """Whether `models` fit the pool under static's partition: every model's weights (and its
    `extra` pages: its adapters'), then what they leave split into equal KV quotas, each at
    least every model's minimal KV."""
    if not models:
        return True
    extra = extra or {}
    capacity = fleet["pool_bytes"] // fleet["page_bytes"]
    left = capacity - sum(weight_pages(fleet, m) + extra.get(m, 0) for m in models)
    return left >= 0 and left // len(models) >= max(min_kv[m] for m in models)


def pick_subset(
    fleet: Mapping[str, Any],
    rows: Sequence[Row],
    order: Sequence[str],
    blocks: Mapping[str, int] | None = None,
) -> list[str]:
    """The busiest models (most requests in `rows`; ties in config `order`) that fit together:
    each in turn joins the subset if the subset still fits with it, else it is skipped. Models
    without requests are left out. A LoRA adapter's requests are its base's (it runs in the
    base's steps), and a base joins with its adapters that have requests, their pages beside
    its own. Returned in config order."""
    adapters = fleet.get("adapters", {})
    base_of = {a: adapters[a]["base"] for a in {r.model for r in rows} if a in adapters}
    unknown = sorted({r.model for r in rows} - set(fleet["models"]) - set(base_of))
    if unknown:
        raise ValueError(f"the server does not serve {unknown}")
    # each adapter's rows as its base's (its KV is the base's)
    rows = [replace(r, model=base_of[r.model]) if r.model in base_of else r for r in rows]
    counts = Counter(r.model for r in rows)
    page = fleet["page_bytes"]
    extra = Counter()
    for a, b in base_of.items():
        extra[b] += -(-adapters[a]["weight_bytes"] // page)
    blocks = blocks or {}
    min_kv = {m: min_kv_pages(fleet, m, rows, blocks.get(m, DEFAULT_BLOCK_SIZE)) for m in counts}
    rank = {m: i for i, m in enumerate(order)}
    chosen: list[str] = []
    for m in sorted(counts, key=lambda m: (-counts[m], rank.get(m, len(rank)))):
        if fits(fleet, [*chosen, m], min_kv, extra):
            chosen.append(m)
    chosen += [a for a, b in base_of.items() if b in chosen]
    return sorted(chosen, key=lambda m: rank.get(m, len(rank)))
