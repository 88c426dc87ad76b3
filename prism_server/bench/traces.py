"""Multi-model workloads from public traces: ServeGen (Alibaba Bailian) client streams as
pseudo-models, and the Mooncake (Kimi) FAST'25 conversation trace, whole or split into
pseudo-models by prompt prefix. The Azure 2023 converter is `workload.from_azure`.

The trace files are the copies described in `shared/traces/*/README.md`; by default they are
looked for in `shared/traces` beside the checkout. Parsed tables are cached per path, so repeated
calls only pay for generation.

Pure Python over rows: nothing here imports the engine.
"""

from __future__ import annotations

import bisect
import csv
import functools
import gzip
import hashlib
import json
import lzma
import random
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from prism_server.bench.workload import Row

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SERVEGEN_WINDOW_S = 600.0
SERVEGEN_LENGTH_WINDOW_S = 21600.0
MOONCAKE_STEP_S = 3.0

_CLIENT_WINDOWS = "servegen_client_windows.csv.xz"
_LENGTH_HISTS = "servegen_model_length_hist_6h.csv.gz"
_MOONCAKE = "conversation_trace.jsonl.gz"


# ---- ServeGen: (model, client) streams --------------------------------------------------------
class _Window(NamedTuple):
    """One client's 10-minute window: mean rate and the fitted inter-arrival distribution."""

    start_s: float
    rate_rps: float
    iat_dist: str
    shape: float
    scale: float


class _Hists(NamedTuple):
    """One model's length histograms for one field, one per 6-hour window, by window start."""

    starts: tuple[float, ...]
    bins: tuple[tuple[tuple[int, int], ...], ...]
    cum: tuple[tuple[float, ...], ...]


@functools.lru_cache(maxsize=4)
def _client_windows(path: Path) -> dict[tuple[str, int], tuple[_Window, ...]]:
    """(model, client id) -> its windows by start; a window absent: the client was silent."""
    streams: dict[tuple[str, int], list[_Window]] = {}
    with lzma.open(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        try:
            cols = [
                header.index(c)
                for c in (
                    "model",
                    "client_id",
                    "window_start_s",
                    "rate_rps",
                    "iat_dist",
                    "param1",
                    "param2",
                )
            ]
        except ValueError:
            raise ValueError(f"{path}: not a ServeGen client-window table") from None
        im, ic, iw, ir, idist, ip1, ip2 = cols
        for i, r in enumerate(reader, start=2):
            if r[idist] not in ("Gamma", "Weibull"):
                raise ValueError(f"{path}:{i}: unknown inter-arrival distribution {r[idist]!r}")
            w = _Window(float(r[iw]), float(r[ir]), r[idist], float(r[ip1]), float(r[ip2]))
            streams.setdefault((r[im], int(r[ic])), []).append(w)
    return {k: tuple(sorted(v)) for k, v in streams.items()}


@functools.lru_cache(maxsize=4)
def _length_hists(path: Path) -> dict[tuple[str, str], _Hists]:
    """(model, field) -> its 6-hour histograms: bins [lo, hi) and cumulative probabilities."""
    raw: dict[tuple[str, str], dict[float, list[tuple[int, int, float]]]] = {}
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            per_window = raw.setdefault((r["model"], r["field"]), {})
            per_window.setdefault(float(r["window_start_s"]), []).append(
                (int(r["bin_lo"]), int(r["bin_hi_excl"]), float(r["prob"]))
            )
    out = {}
    for key, per_window in raw.items():
        starts = tuple(sorted(per_window))
        bins, cums = [], []
        for s in starts:
            rows = sorted(per_window[s])
            acc, cum = 0.0, []
            for _, _, p in rows:
                acc += p
                cum.append(acc)
            bins.append(tuple((lo, hi) for lo, hi, _ in rows))
            cums.append(tuple(cum))
        out[key] = _Hists(starts, tuple(bins), tuple(cums))
    return out


def _hist_at(h: _Hists, t: float) -> int:
    """The index of the 6-hour histogram containing time t, else of the nearest one."""
    i = bisect.bisect_right(h.starts, t) - 1
    if i < 0:
        return 0
    if t < h.starts[i] + SERVEGEN_LENGTH_WINDOW_S or i + 1 == len(h.starts):
        return i
    after_end = t - (h.starts[i] + SERVEGEN_LENGTH_WINDOW_S)
    return i if after_end <= h.starts[i + 1] - t else i + 1


def _draw_lengths(rng: random.Random, h: _Hists, t: float, k: int) -> list[int]:
    """k lengths: a bin by its probability, then a uniform integer inside it."""
    i = _hist_at(h, t)
    return [
        lo + int(rng.random() * (hi - lo))
        for lo, hi in rng.choices(h.bins[i], cum_weights=h.cum[i], k=k)
    ]


def _window_arrivals(rng: random.Random, w: _Window, rate_scale: float) -> list[float]:
    """Absolute arrival times in one window, ServeGen's way: as many IATs as the window's expected
    count (rate x 600 s x rate_scale, rounded up or down at random so the expectation holds),
    drawn from the fitted distribution and rescaled to sum to the window, then rotated by a random
    phase so that the window does not start with an arrival; the gaps stay the drawn ones."""
    expected = w.rate_rps * SERVEGEN_WINDOW_S * rate_scale
    k = int(expected)
    if rng.random() < expected - k:
        k += 1
    if k == 0:
        return []
    if w.iat_dist == "Gamma":
        gaps = [rng.gammavariate(w.shape, w.scale) for _ in range(k)]
    else:
        gaps = [rng.weibullvariate(w.scale, w.shape) for _ in range(k)]
    total = sum(gaps)
    if total <= 0.0:  # every draw underflowed: one burst is what such a fit means
        gaps, total = [0.0] * (k - 1) + [1.0], 1.0
    f = SERVEGEN_WINDOW_S / total
    t = rng.random() * SERVEGEN_WINDOW_S
    out = []
    for g in gaps:
        t += g * f
        out.append(w.start_s + t % SERVEGEN_WINDOW_S)
    out.sort()
    return out


def _servegen_root(root: Path | None) -> Path:
    return Path(root) if root is not None else TRACES / "servegen"


def servegen_streams(
    source_models: Sequence[str] = ("m-large", "m-mid", "m-small"),
    start_s: float = 0.0,
    duration_s: float = 3600.0,
    root: Path | None = None,
) -> list[tuple[str, int, float]]:
    """Every (source model, client id) stream of `source_models` with requests in
    [start_s, start_s + duration_s), busiest first (ties by model, then client), with its expected
    request count there: the sum of rate_rps x the seconds of each of its windows inside the span.
    """
    if duration_s <= 0:
        raise ValueError("the duration must be positive")
    table = _client_windows(_servegen_root(root) / _CLIENT_WINDOWS)
    known = {m for m, _ in table}
    unknown = sorted(set(source_models) - known)
    if unknown or not source_models:
        raise ValueError(f"unknown ServeGen models {unknown}; the trace has {sorted(known)}")
    end_s = start_s + duration_s
    sources = set(source_models)
    ranked = []
    for (model, client), windows in table.items():
        if model not in sources:
            continue
        volume = sum(
            w.rate_rps
            * max(0.0, min(w.start_s + SERVEGEN_WINDOW_S, end_s) - max(w.start_s, start_s))
            for w in windows
        )
        if volume > 0:
            ranked.append((model, client, volume))
    ranked.sort(key=lambda s: (-s[2], s[0], s[1]))
    return ranked


def parse_stream(text: str) -> tuple[str, int]:
    """ "m-large/c61" -> ("m-large", 61)."""
    source, sep, client = text.strip().rpartition("/c")
    if not sep or not source or not client.isdigit():
        raise ValueError(f"a ServeGen stream is MODEL/cCLIENT (e.g. m-large/c61), got {text!r}")
    return source, int(client)


def _pick(
    models: Sequence[str] | None,
    n: int | None,
    source_models: Sequence[str],
    start_s: float,
    duration_s: float,
    root: Path | None,
    streams: Sequence[str] | None = None,
) -> list[tuple[str, str, int]]:
    """(served name, source model, client id) for the n busiest streams, busiest first; or, with
    `streams` ("m-large/c61", ...), those streams for `models` in order."""
    if streams is not None:
        if models is None or len(models) != len(streams) or len(set(models)) != len(models):
            raise ValueError("name one distinct served model per ServeGen stream")
        table = _client_windows(_servegen_root(root) / _CLIENT_WINDOWS)
        picked = []
        for name, text in zip(models, streams):
            source, client = parse_stream(text)
            if (source, client) not in table:
                raise ValueError(f"the ServeGen trace has no stream {text!r}")
            picked.append((name, source, client))
        return picked
    if models is not None:
        n = len(models) if n is None else n
        if n > len(models):
            raise ValueError(f"n = {n} streams but only {len(models)} model names")
    if n is None or n < 1:
        raise ValueError("name the served models or give n >= 1")
    if models is not None and len(set(models[:n])) < n:
        raise ValueError("the served model names must be distinct")
    streams = servegen_streams(source_models, start_s, duration_s, root)
    if len(streams) < n:
        raise ValueError(f"{n} streams asked for, {len(streams)} have requests in the span")
    return [
        (models[i] if models is not None else f"{m}-c{c}", m, c)
        for i, (m, c, _) in enumerate(streams[:n])
    ]


def servegen_mapping(
    models: Sequence[str] | None = None,
    n: int | None = None,
    source_models: Sequence[str] = ("m-large", "m-mid", "m-small"),
    start_s: float = 0.0,
    duration_s: float = 3600.0,
    root: Path | None = None,
    streams: Sequence[str] | None = None,
) -> dict[str, str]:
    """Served model name -> the stream `from_servegen` gives it with the same arguments, as
    "m-large/c61", busiest first."""
    return {
        name: f"{m}/c{c}"
        for name, m, c in _pick(models, n, source_models, start_s, duration_s, root, streams)
    }


def from_servegen(
    models: Sequence[str] | None = None,
    n: int | None = None,
    source_models: Sequence[str] = ("m-large", "m-mid", "m-small"),
    start_s: float = 0.0,
    duration_s: float = 3600.0,
    window_scale: float = 1.0,
    rate_scale: float = 1.0,
    seed: int = 0,
    root: Path | None = None,
    streams: Sequence[str] | None = None,
) -> list[Row]:
    """ServeGen's fine mapping: each (source model, client) stream is one served model. The n
    busiest streams of `source_models` over [start_s, start_s + duration_s) go, in rank order, to
    `models` (models[0] gets the busiest; n defaults to len(models)) or, without names, to
    "<source>-c<client>"; or `streams` names the stream of each of `models` ("m-large/c61");
    `servegen_mapping` prints the choice.

    Each 10-minute window a stream has gets its expected count of requests (rate_rps x 600 s x
    `rate_scale`) with gaps from the window's fitted Gamma/Weibull distribution, rescaled to fill
    the window; a window the stream lacks stays silent. Lengths come from the source model's
    6-hour input/output histograms (mm-image: text + image tokens as the prompt).

    Arrivals are seconds from start_s times `window_scale`: 0.1 turns each 10-minute window into
    60 s, the same requests in a tenth of the time, so the rate per second is
    rate_rps x rate_scale / window_scale (rate_scale = window_scale keeps the real per-second
    rates over the shorter span). The trace's rates are large (the busiest stream of m-mid sends
    hundreds of requests a second), so a bench on a few GPUs wants rate_scale well below 1.

    Deterministic for a seed; each window draws from its own generator (seed, stream, window),
    so a window's requests do not depend on the span, the other streams or window_scale. `root`
    is the folder of the ServeGen files (by default shared/traces/servegen)."""
    if window_scale <= 0 or rate_scale <= 0:
        raise ValueError("window_scale and rate_scale must be positive")
    picked = _pick(models, n, source_models, start_s, duration_s, root, streams)
    base = _servegen_root(root)
    table = _client_windows(base / _CLIENT_WINDOWS)
    hists = _length_hists(base / _LENGTH_HISTS)
    end_s = start_s + duration_s
    rows: list[Row] = []
    for name, source, client in picked:
        if (source, "input_tokens") in hists:
            prompt_fields = ("input_tokens",)
        else:
            prompt_fields = ("text_tokens", "image_tokens")
        try:
            prompt_hists = [hists[(source, f)] for f in prompt_fields]
            output_hist = hists[(source, "output_tokens")]
        except KeyError:
            raise ValueError(f"no length histograms for ServeGen model {source!r}") from None
        for w in table[(source, client)]:
            if w.start_s + SERVEGEN_WINDOW_S <= start_s or w.start_s >= end_s:
                continue
            rng = random.Random(f"servegen/{seed}/{source}/{client}/{w.start_s!r}")
            times = _window_arrivals(rng, w, rate_scale)
            k = len(times)
            prompts = [0] * k
            for h in prompt_hists:
                prompts = [a + b for a, b in zip(prompts, _draw_lengths(rng, h, w.start_s, k))]
            outputs = _draw_lengths(rng, output_hist, w.start_s, k)
            rows.extend(
                Row((t - start_s) * window_scale, name, max(p, 1), max(o, 1))
                for t, p, o in zip(times, prompts, outputs)
                if start_s <= t < end_s
            )
    return sorted(rows, key=lambda r: r.arrival_s)


# ---- Mooncake FAST'25 conversation trace ------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _mooncake(path: Path) -> tuple[tuple[int, int, int, tuple[int, ...]], ...]:
    """(timestamp ms, input length, output length, hash ids) per request, sorted by timestamp."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(
                    (
                        int(r["timestamp"]),
                        int(r["input_length"]),
                        int(r["output_length"]),
                        tuple(int(h) for h in r.get("hash_ids", ())),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return tuple(sorted(out, key=lambda r: r[0]))


def _common_prefix(ids: Sequence[tuple[int, ...]]) -> int:
    """How many leading hash ids every request shares."""
    if not ids:
        return 0
    first = ids[0]
    n = len(first)
    for h in ids[1:]:
        n = min(n, len(h))
        while n and h[:n] != first[:n]:
            n -= 1
        if n == 0:
            break
    return n


def _split_key(hash_ids: Sequence[int], common: int) -> str:
    """The block a request is split on: the first past the `common` leading blocks that all
    requests share, else its last block."""
    if len(hash_ids) > common:
        return str(hash_ids[common])
    return str(hash_ids[-1]) if hash_ids else ""


def _bucket(key: str, n: int) -> int:
    return int(hashlib.blake2b(key.encode(), digest_size=4).hexdigest(), 16) % n


def from_mooncake(
    models: Sequence[str],
    path: Path | None = None,
    limit_s: float | None = None,
    spread: bool = True,
    seed: int = 0,
) -> list[Row]:
    """The Mooncake conversation trace (12,031 requests in an hour, long prompts), arrivals in
    seconds from its first timestamp. With one model every request goes to it; with several, a
    stable hash of the request's first own prefix block picks the model, so requests sharing a
    prefix stay on one model and each keeps its prefix-sharing pattern. In this file hash_ids[0]
    is block 0 for every request (a prompt head all share), so the split is on hash_ids[1].

    Timestamps come in ~3 s steps; `spread` places the requests of one step uniformly at random
    (seeded, in file order) over [t, t + 3 s) or up to the next step if sooner; without it they
    arrive as one burst at t. `limit_s` keeps the arrivals before it."""
    if not models:
        raise ValueError("name at least one model")
    recs = _mooncake(Path(path) if path is not None else TRACES / "mooncake_fast25" / _MOONCAKE)
    if not recs:
        return []
    common = _common_prefix([h for *_, h in recs])
    rng = random.Random(seed)
    t0 = recs[0][0]
    rows: list[Row] = []
    i = 0
    while i < len(recs):
        j = i
        while j < len(recs) and recs[j][0] == recs[i][0]:
            j += 1
        t = (recs[i][0] - t0) / 1000.0
        if spread:
            width = MOONCAKE_STEP_S
            if j < len(recs):
                width = min(width, (recs[j][0] - recs[i][0]) / 1000.0)
            times = sorted(t + rng.random() * width for _ in range(j - i))
        else:
            times = [t] * (j - i)
        for at, (_, prompt, output, hash_ids) in zip(times, recs[i:j]):
            if limit_s is not None and at >= limit_s:
                continue
            m = (
                models[0]
                if len(models) == 1
                else models[_bucket(_split_key(hash_ids, common), len(models))]
            )
            rows.append(Row(at, m, max(prompt, 1), max(output, 1)))
        i = j
    return sorted(rows, key=lambda r: r.arrival_s)
