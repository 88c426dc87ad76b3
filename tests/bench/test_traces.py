"""Trace converters on the real files: ServeGen streams (ranking, mapping, counts per window,
silent windows, burstiness, lengths, time and rate scaling, determinism) and the Mooncake
conversation trace (all requests, the prefix split, spreading of the 3 s steps)."""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from prism_server.bench.traces import (
    from_mooncake,
    from_servegen,
    servegen_mapping,
    servegen_streams,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SERVEGEN = TRACES / "servegen"
MOONCAKE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl.gz"

pytestmark = pytest.mark.skipif(
    not TRACES.exists(), reason="the shared traces are not beside the checkout"
)

SOURCE = ("m-large",)
SPAN_S = 7200.0
RATE = 0.01  # m-large's busiest client sends ~80 req/s: keep the tests' row counts small
W = 600.0


@pytest.fixture(scope="module")
def windows() -> dict[int, dict[float, dict[str, str]]]:
    """m-large client -> window start -> its row, read straight from the table."""
    out: dict[int, dict[float, dict[str, str]]] = defaultdict(dict)
    with lzma.open(SERVEGEN / "servegen_client_windows.csv.xz", "rt", newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] == SOURCE[0]:
                out[int(r["client_id"])][float(r["window_start_s"])] = r
    return out


@pytest.fixture(scope="module")
def ranked(windows) -> list[tuple[int, float]]:
    """m-large clients by expected requests over [0, SPAN_S), busiest first."""
    vol = {
        c: sum(float(r["rate_rps"]) * W for s, r in ws.items() if s < SPAN_S)
        for c, ws in windows.items()
    }
    return sorted(((c, v) for c, v in vol.items() if v > 0), key=lambda cv: (-cv[1], cv[0]))


@pytest.fixture(scope="module")
def top3() -> list:
    return from_servegen(["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S, rate_scale=RATE)


def _by_model(rows) -> dict[str, list]:
    out = defaultdict(list)
    for r in rows:
        out[r.model].append(r)
    return out


def test_streams_are_ranked_by_volume_and_mapped_in_rank_order(ranked):
    streams = servegen_streams(SOURCE, 0.0, SPAN_S, root=SERVEGEN)
    assert [(c, round(v)) for _, c, v in streams[:10]] == [(c, round(v)) for c, v in ranked[:10]]
    assert {m for m, _, _ in streams} == set(SOURCE)
    mapping = servegen_mapping(["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S)
    assert mapping == {name: f"m-large/c{c}" for name, (c, _) in zip("abc", ranked)}
    unnamed = servegen_mapping(n=2, source_models=SOURCE, duration_s=SPAN_S)
    assert list(unnamed) == [f"m-large-c{c}" for c, _ in ranked[:2]]


def test_counts_follow_the_windows_rates(top3, windows, ranked):
    assert [r.arrival_s for r in top3] == sorted(r.arrival_s for r in top3)
    assert all(0 <= r.arrival_s < SPAN_S for r in top3)
    per = _by_model(top3)
    assert set(per) == {"a", "b", "c"}
    for name, (client, _) in zip("abc", ranked):
        present = [s for s in windows[client] if s < SPAN_S]
        for s in present:  # each window: its rate x 600 s x RATE, rounded up or down
            got = sum(1 for r in per[name] if s <= r.arrival_s < s + W)
            assert abs(got - float(windows[client][s]["rate_rps"]) * W * RATE) < 1
    assert len(per["a"]) > len(per["b"]) > len(per["c"])


def test_rate_scale_scales_the_count(top3):
    double = from_servegen(
        ["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S, rate_scale=2 * RATE
    )
    assert abs(len(double) / len(top3) - 2) < 0.01


def test_window_scale_compresses_time_and_keeps_the_requests(top3):
    fast = from_servegen(
        ["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S, rate_scale=RATE, window_scale=0.1
    )
    assert len(fast) == len(top3)
    assert max(r.arrival_s for r in fast) < SPAN_S * 0.1
    assert [(r.model, r.prompt_len, r.output_len) for r in fast] == [
        (r.model, r.prompt_len, r.output_len) for r in top3
    ]
    assert all(abs(f.arrival_s - 0.1 * r.arrival_s) < 1e-9 for f, r in zip(fast, top3))


def test_deterministic_per_seed_and_independent_of_the_span(top3):
    again = from_servegen(["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S, rate_scale=RATE)
    assert again == top3
    other = from_servegen(
        ["a", "b", "c"], source_models=SOURCE, duration_s=SPAN_S, rate_scale=RATE, seed=1
    )
    assert len(other) > 0 and other != top3
    # one window asked for alone is that window of the longer span (the busiest stream is the
    # same over both spans, and each window draws from its own generator)
    one = from_servegen(["a"], source_models=SOURCE, start_s=W, duration_s=W, rate_scale=RATE)
    assert servegen_mapping(["a"], source_models=SOURCE, start_s=W, duration_s=W) == (
        servegen_mapping(["a"], source_models=SOURCE, duration_s=SPAN_S)
    )
    cut = [r for r in top3 if r.model == "a" and W <= r.arrival_s < 2 * W]
    assert [(r.prompt_len, r.output_len) for r in one] == [
        (r.prompt_len, r.output_len) for r in cut
    ]
    assert all(abs(o.arrival_s - (c.arrival_s - W)) < 1e-9 for o, c in zip(one, cut))


def test_windows_a_client_lacks_stay_silent(windows, ranked):
    spans = range(int(SPAN_S // W))
    gappy = next(
        (i, c)
        for i, (c, _) in enumerate(ranked[:20])
        if any(float(k * W) not in windows[c] for k in spans)
    )
    rank, client = gappy
    rows = from_servegen(n=rank + 1, source_models=SOURCE, duration_s=SPAN_S, rate_scale=RATE)
    mine = [r.arrival_s for r in rows if r.model == f"m-large-c{client}"]
    for k in spans:
        got = sum(1 for t in mine if k * W <= t < (k + 1) * W)
        row = windows[client].get(float(k * W))
        if row is None:
            assert got == 0
        else:
            assert abs(got - float(row["rate_rps"]) * W * RATE) < 1


def test_high_cv_windows_are_bursty(top3, windows, ranked):
    cands = [
        (float(r["iat_cv"]), s, name)
        for name, (c, _) in zip("abc", ranked)
        for s, r in windows[c].items()
        if s < SPAN_S and float(r["rate_rps"]) * W * RATE >= 200
    ]
    cv, start, name = max(cands)
    assert cv > 1.5
    times = [r.arrival_s for r in top3 if r.model == name and start <= r.arrival_s < start + W]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) > 1


def test_lengths_come_from_the_source_models_histograms(top3):
    bins: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    with gzip.open(SERVEGEN / "servegen_model_length_hist_6h.csv.gz", "rt", newline="") as f:
        for r in csv.DictReader(f):  # the span lies in the first 6-hour window
            if r["model"] == SOURCE[0] and float(r["window_start_s"]) == 0.0:
                bins[r["field"]].append((int(r["bin_lo"]), int(r["bin_hi_excl"]), float(r["prob"])))
    for field, got in (
        ("input_tokens", [r.prompt_len for r in top3]),
        ("output_tokens", [r.output_len for r in top3]),
    ):
        support = bins[field]
        assert all(any(lo <= x < hi for lo, hi, _ in support) or x == 1 for x in set(got))
        assert max(got) < max(hi for _, hi, _ in support)
        acc, lo_q, hi_q = 0.0, None, None  # the median lies between the 40th and 60th percentiles
        for lo, hi, p in sorted(support):
            acc += p
            if lo_q is None and acc >= 0.4:
                lo_q = lo
            if hi_q is None and acc >= 0.6:
                hi_q = hi
        assert lo_q <= statistics.median(got) < hi_q


def test_servegen_rejects_bad_requests():
    with pytest.raises(ValueError, match="unknown ServeGen models"):
        from_servegen(["a"], source_models=("m-huge",))
    with pytest.raises(ValueError, match="name the served models"):
        from_servegen(source_models=SOURCE)
    with pytest.raises(ValueError, match="only 1 model names"):
        from_servegen(["a"], n=2, source_models=SOURCE)
    with pytest.raises(ValueError, match="have requests in the span"):
        servegen_mapping(n=10_000, source_models=SOURCE)
    with pytest.raises(ValueError, match="positive"):
        from_servegen(["a"], source_models=SOURCE, window_scale=0)


# ---- Mooncake -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mooncake() -> list[dict]:
    with gzip.open(MOONCAKE, "rt") as f:
        return [json.loads(line) for line in f]


def test_one_model_gets_every_request_with_its_lengths(mooncake):
    rows = from_mooncake(["kimi"], spread=False)
    assert len(rows) == len(mooncake) == 12_031  # the README's count
    assert {r.model for r in rows} == {"kimi"}
    t0 = mooncake[0]["timestamp"]
    assert [r.arrival_s for r in rows] == [(m["timestamp"] - t0) / 1000 for m in mooncake]
    assert [(r.prompt_len, r.output_len) for r in rows] == [
        (m["input_length"], m["output_length"]) for m in mooncake
    ]
    early = from_mooncake(["kimi"], spread=False, limit_s=600)
    assert len(early) == sum(1 for m in mooncake if m["timestamp"] - t0 < 600_000)


def test_spreading_stays_inside_each_3s_step(mooncake):
    rows = from_mooncake(["kimi"], spread=True, seed=3)
    assert len(rows) == len(mooncake)
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
    stamps = sorted({m["timestamp"] for m in mooncake})
    following = dict(zip(stamps, stamps[1:] + [stamps[-1] + 3000]))
    for r, m in zip(rows, mooncake):  # the file order is kept, so row i is request i
        assert (r.prompt_len, r.output_len) == (m["input_length"], m["output_length"])
        t = m["timestamp"] / 1000
        assert t <= r.arrival_s < min(t + 3, following[m["timestamp"]] / 1000)
    assert len({r.arrival_s for r in rows}) == len(rows)  # no bursts left
    assert from_mooncake(["kimi"], seed=3) == rows and from_mooncake(["kimi"], seed=4) != rows


def test_the_split_keeps_each_prefix_on_one_model(mooncake):
    # every request starts with block 0, so the split is on the first block of its own
    assert {m["hash_ids"][0] for m in mooncake} == {0}
    models = ["x", "y", "z"]
    rows = from_mooncake(models, seed=0)
    assert len(rows) == len(mooncake)
    assert {r.model for r in rows} == set(models)
    owner: dict[tuple[int, int], str] = {}
    for r, m in zip(rows, mooncake):
        assert (r.prompt_len, r.output_len) == (m["input_length"], m["output_length"])
        assert owner.setdefault(tuple(m["hash_ids"][:2]), r.model) == r.model
    shares = [sum(1 for r in rows if r.model == x) / len(rows) for x in models]
    assert all(0.2 < s < 0.47 for s in shares)
    turns = Counter(tuple(m["hash_ids"][:2]) for m in mooncake)
    assert sum(1 for v in turns.values() if v > 1) > 1000  # many prefixes with several requests
