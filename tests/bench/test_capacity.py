"""The bench where weights move: the static subset that fits the pool (from the sizes a server
reports), the configs derived for part of the fleet, the request log joined for each missed
request's cause, the capacity sweep's stopping rule; and the capacity sweep end to end on tiny
models with a pool that holds about a third of the fleet."""

from __future__ import annotations

import json

import pytest
import tomllib

from prism_server.bench.capacity import capacity_of, model_counts
from prism_server.bench.causes import CAUSES, TTFT_WAITS, cause, collect, join, read_log
from prism_server.bench.fleet import (
    derive_config,
    dumps_toml,
    fits,
    min_kv_pages,
    pick_subset,
    rows_of,
    weight_pages,
)
from prism_server.bench.replay import STOPPED, Result
from prism_server.bench.report import report
from prism_server.bench.sweep_run import _record
from prism_server.bench.sweep_table import ratios, slo_table, subset_runs, table
from prism_server.bench.workload import Row

MIB = 1 << 20


# ---- derived configs -----------------------------------------------------------------------------
FLEET_TOML = """
[server]
api_key = "k"

[engine]
device = "cpu"
page_bytes = 1048576
kv_budget_bytes = 8388608
profile_budget_s = 0.0

[[models]]
name = "a"
source = "dummy:tiny-llama"
block_size = 4

[[models]]
name = "b"
source = "dummy:tiny-llama"
seed = 1
ttft_slo_ms = 500.0

[[models]]
name = "c"
source = "dummy:tiny-llama"
seed = 2
"""


def test_a_derived_config_keeps_everything_but_the_other_models(tmp_path):
    src = tmp_path / "fleet.toml"
    src.write_text(FLEET_TOML.replace("kv_budget_bytes = 8388608\n", ""))
    dst = derive_config(src, ["c", "a"], tmp_path / "sub.toml")
    got, full = tomllib.loads(dst.read_text()), tomllib.loads(src.read_text())
    assert [m["name"] for m in got["models"]] == ["a", "c"]  # config order
    assert got["models"] == [full["models"][0], full["models"][2]]
    assert got["engine"] == full["engine"] and got["server"] == full["server"]
    with pytest.raises(ValueError, match=r"no such models \['x'\]"):
        derive_config(src, ["a", "x"], tmp_path / "bad.toml")
    # the models under [engine] as well
    nested = {"engine": {"device": "cpu", "models": full["models"]}}
    (tmp_path / "nested.toml").write_text(dumps_toml(nested))
    out = derive_config(tmp_path / "nested.toml", ["b"], tmp_path / "n.toml")
    assert tomllib.loads(out.read_text()) == {
        "engine": {"device": "cpu", "models": [nested["engine"]["models"][1]]}
    }


def test_a_kv_budget_becomes_the_whole_fleets_pool(tmp_path):
    src = tmp_path / "fleet.toml"
    src.write_text(FLEET_TOML)
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        derive_config(src, ["a"], tmp_path / "sub.toml")
    got = tomllib.loads(derive_config(src, ["a"], tmp_path / "s.toml", 24 * MIB).read_text())
    assert got["engine"]["pool_budget_bytes"] == 24 * MIB
    assert "kv_budget_bytes" not in got["engine"]


def test_the_toml_writer_round_trips_what_tomllib_reads():
    data = {
        "title": 'quote " and \\ and \t tab',
        "engine": {"x": 1.5, "n": -3, "on": False, "list": [1, "two", 3.0], "inline": {"k": 1}},
        "models": [{"name": "a b", "sub": {"deep": {"v": 1}}}, {"name": "c", "arr": []}],
        "empty": {},
    }
    assert tomllib.loads(dumps_toml(data)) == data


# ---- the subset that fits ------------------------------------------------------------------------
def _fleet(weights: dict[str, int], pool_pages: int, page: int = MIB, kv_block: int = 64 << 10):
    return {
        "page_bytes": page,
        "pool_bytes": pool_pages * page,
        "models": {
            m: {"weight_bytes": w, "weight_pool_bytes": 0, "kv_block_bytes": kv_block}
            for m, w in weights.items()
        },
    }


def test_the_subset_is_the_busiest_models_that_fit_with_their_minimal_kv():
    # weights in pages: a 3, b 3, c 5, d 1, e 2; pool 12 pages
    fleet = _fleet({"a": 3 * MIB, "b": 3 * MIB - 1, "c": 5 * MIB, "d": MIB // 2, "e": 2 * MIB}, 12)
    assert [weight_pages(fleet, m) for m in "abcde"] == [3, 3, 5, 1, 2]
    # requests: c busiest, then a, e, b; d none. Longest request of c: 40 blocks of 16 tokens at
    # 64 KiB = 2.5 MiB -> 3 pages
    rows = [Row(0.1 * i, "c", 600, 40) for i in range(5)]
    rows += [Row(0.1 * i, "a", 10, 6) for i in range(4)]
    rows += [Row(0.1 * i, "e", 10, 6) for i in range(3)]
    rows += [Row(0.1 * i, "b", 10, 6) for i in range(2)]
    assert min_kv_pages(fleet, "c", rows, 16) == 3 and min_kv_pages(fleet, "a", rows, 16) == 1
    minkv = {"a": 1, "b": 1, "c": 3, "e": 1}
    # c + a: 8 weights, 4 left -> 2 each < 3 (c's minimum): a does not join; c + e: 7, 5 left ->
    # 2 each < 3: no; c + b: 8: no. c alone fits (7 left)
    assert fits(fleet, ["c"], minkv) and not fits(fleet, ["c", "a"], minkv)
    assert pick_subset(fleet, rows, list("abcde"), {m: 16 for m in "abcde"}) == ["c"]
    # short requests everywhere: c (5) + a (3) + e (2) = 10 pages, 2 left < 3 models x 1
    short = [Row(r.arrival_s, r.model, 10, 6) for r in rows]
    assert pick_subset(fleet, short, list("abcde")) == ["a", "c"]
    # a smaller pool skips the big busy model for the next ones; d (no requests) never joins
    small = _fleet({"a": 3 * MIB, "b": 3 * MIB, "c": 9 * MIB, "d": MIB, "e": 2 * MIB}, 8)
    assert pick_subset(small, short, list("abcde")) == ["a", "e"]
    assert rows_of(rows, ["a", "e"]) == [r for r in rows if r.model in "ae"]
    with pytest.raises(ValueError, match="does not serve"):
        pick_subset(small, [*rows, Row(0.0, "zz", 1, 1)], list("abcde"))


def test_a_base_joins_the_subset_with_its_adapters_their_requests_and_pages_its_own():
    """Adapters run in their base's steps: their requests count as the base's (a busy set of
    adapters brings a quiet base in), their pages beside its weights, and the base comes with
    those of them that have requests; an adapter's KV is its base's."""
    # weights in pages: base 3, solo 4; the adapters 1 page each; pool 10 pages
    fleet = _fleet({"base": 3 * MIB, "solo": 4 * MIB}, 10)
    fleet["adapters"] = {
        n: {"base": "base", "weight_bytes": MIB // 2} for n in ("ft0", "ft1", "ft2")
    }
    order = ["base", "solo", "ft0", "ft1", "ft2"]
    # solo alone is busier than the base alone, the base with its adapters busier still
    rows = [Row(0.1 * i, "solo", 10, 6) for i in range(4)]
    rows += [Row(0.1 * i, "ft0", 10, 6) for i in range(3)] + [Row(0.5, "ft1", 10, 6)]
    rows += [Row(0.6, "base", 10, 6)]
    # base 3 + ft0 + ft1 (ft2: no requests) = 5, solo 4: 9 pages, 1 left < 2 x 1: solo is out
    assert pick_subset(fleet, rows, order) == ["base", "ft0", "ft1"]
    assert pick_subset({**fleet, "pool_bytes": 11 * MIB}, rows, order) == [
        "base",
        "solo",
        "ft0",
        "ft1",
    ]
    # an adapter's long request sizes its base's minimal KV: 40 blocks of 16 at 64 KiB, 3 pages
    long = [*rows, Row(0.7, "ft1", 600, 40)]
    assert pick_subset({**fleet, "pool_bytes": 14 * MIB}, long, order) == ["base", "ft0", "ft1"]
    with pytest.raises(ValueError, match="does not serve"):
        pick_subset(fleet, [*rows, Row(0.0, "ft9", 1, 1)], order)


# ---- the miss causes -----------------------------------------------------------------------------
def _result(model, sent, ttft, gaps, error=None, rid=None):
    r = Result(Row(sent, model, 8, len(gaps) + 1), sent=sent, error=error, done=True, id=rid)
    if ttft is not None:
        t = sent + ttft
        r.token_times = [t]
        for g in gaps:
            t += g
            r.token_times.append(t)
        r.tokens = len(r.token_times)
    return r


def _waits(**kw):
    return {
        k: kw.get(k, 0.0)
        for k in (
            "offloaded",
            "activation",
            "kv",
            "other_models",
            "queue",
            "prefill",
            "decode",
            "decode_other_models",
            "preempted",
        )
    }


def test_each_missed_request_gets_the_cause_the_log_names_and_they_add_up():
    slos = {"a": (1.0, 0.1), "b": (0.5, 0.05)}
    results = [
        _result("a", 0.0, 0.2, [0.05] * 3, rid="r0"),  # met
        _result("a", 0.1, 2.0, [0.05] * 3, rid="r1"),  # TTFT miss: waited for activation
        _result("b", 0.2, 0.9, [0.01], rid="r2"),  # TTFT miss: behind other models
        _result("b", 0.3, 0.1, [0.2, 0.2], rid="r3"),  # TPOT only: preempted
        _result("a", 0.4, 0.3, [0.5], rid="r4"),  # TPOT only: other models' steps
        _result("a", 0.5, None, [], error="HTTP 503: busy"),  # no id, no line
        _result("b", 0.6, None, [], error=STOPPED, rid="r6"),
        _result("a", 0.7, 3.0, [], rid="r7"),  # missed, but the log has no line for it
        _result("b", 0.8, 0.1, [0.01], rid="r8"),  # met, no line
    ]
    lines = {
        "r0": {"id": "r0", "waits": _waits(prefill=0.1), "preemptions": 0, "recomputed_tokens": 0},
        "r1": {"id": "r1", "waits": _waits(activation=1.5, queue=0.4), "preemptions": 0},
        "r2": {"id": "r2", "waits": _waits(other_models=0.6, kv=0.2, decode=0.3)},
        "r3": {
            "id": "r3",
            "waits": _waits(decode=0.1, preempted=0.3, decode_other_models=0.05),
            "preemptions": 2,
            "recomputed_tokens": 17,
        },
        "r4": {"id": "r4", "waits": _waits(decode=0.1, decode_other_models=0.4, queue=5.0)},
        "r6": {"id": "r6", "waits": _waits(), "preemptions": 1, "recomputed_tokens": 5},
    }
    for line in lines.values():
        line.setdefault("preemptions", 0)
        line.setdefault("recomputed_tokens", 0)
    records = [_record(r) for r in results]
    got = join(records, lines, slos)
    assert [r["cause"] for r in records] == [
        None,
        "activation",
        "other_models",
        "preempted",
        "decode_other_models",
        "error",
        "stopped",
        "unknown",
        None,
    ]
    rep = report(results, slos, 1.0)
    missed = round(len(results) * (1 - rep["overall"]["attainment"]))
    assert sum(got["miss_causes"].values()) == missed == 7
    assert set(got["miss_causes"]) <= set(CAUSES)
    assert got["preemptions"] == 3 and got["recomputed_tokens"] == 22 and got["logged"] == 6
    assert records[3]["waits"]["preempted"] == 0.3 and records[3]["preemptions"] == 2
    assert records[8]["waits"] is None and records[8]["preemptions"] is None
    # no log at all: every miss but the errors is unknown, the counts still add up
    bare = [_record(r) for r in results]
    none = join(bare, {}, slos)
    assert none["miss_causes"] == {"error": 1, "stopped": 1, "unknown": 5}
    assert cause(bare[0], *slos["a"], None) is None


def test_the_log_is_read_from_the_runs_offset_and_a_line_cut_short_is_skipped(tmp_path):
    import asyncio

    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps({"id": "old"}) + "\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(json.dumps({"id": "x", "waits": {}}) + "\nnot json\n" + '{"id": "y", "wa')
    assert set(read_log(log, offset)) == {"x"} and set(read_log(log)) == {"old", "x"}
    assert read_log(tmp_path / "none.jsonl") == {} and read_log(None) == {}
    # collect waits for the ids it wants, then gives up with what it has
    got = asyncio.run(collect(log, offset, ["x", "y"], wait_s=0.3))
    assert set(got) == {"x"}
    assert asyncio.run(collect(None, 0, ["x"], wait_s=5)) == {}


# ---- the capacity sweep's rule -------------------------------------------------------------------
def test_capacity_is_the_largest_n_below_every_failing_one():
    def pts(*atts):
        return [{"n": 2 * (i + 1), "attainment": a} for i, a in enumerate(atts)]

    assert capacity_of(pts(1.0, 0.995, 0.9), 0.99) == 4
    assert capacity_of(pts(1.0, 0.9, 1.0), 0.99) == 2  # a lucky pass above a failure
    assert capacity_of(pts(0.5), 0.99) is None
    assert capacity_of(pts(1.0, None), 0.99) == 2  # a server that did not start fails
    assert capacity_of(pts(1.0, 1.0, 1.0), 0.99) == 6
    assert model_counts(6, 2, 2) == [2, 4, 6]
    assert model_counts(7, 2, 2) == [2, 4, 6, 7]
    assert model_counts(3, 1, 1) == [1, 2, 3]
    with pytest.raises(ValueError, match="only 3 models"):
        model_counts(3, 4, 1)


# ---- the static subset's row and ratio -----------------------------------------------------------
def _run(scale, reqs, base=1.0, **kw):
    met = sum(r["ok"] for r in reqs) / len(reqs)
    records = [
        {
            "model": r["model"],
            "ttft_s": 0.1 if r["ok"] else 9.0,
            "tpot_s": 0.01,
            "error": None,
            "tokens": 4,
        }
        for r in reqs
    ]
    return {
        "scale": scale,
        "rate_rps": base * scale,
        "report": {
            "overall": {"attainment": met, "requests": len(reqs), "errors": 0}
            | dict.fromkeys(("ttft_attainment", "tpot_attainment", "goodput_rps")),
            "models": {},
        },
        "requests": records,
        "activations": 1,
        "evictions": 1,
        "activation_wait": {"requests": 0, "ttft_p99_s": None},
        **kw,
    }


def test_prism_is_compared_with_static_on_statics_subset_and_the_table_says_so():
    slos = {m: {"ttft_s": 1.0, "tpot_s": 0.1} for m in "abc"}
    # prism misses only c's requests at x2 and everything's at x4: on the subset {a, b} it
    # keeps x2, though it fails x2 on the whole fleet
    ok = [{"model": m, "ok": True} for m in "aabbc"]
    x2 = [{"model": m, "ok": m != "c"} for m in "aabbc"]
    prism_runs = [
        _run(1, ok, 2.5, miss_causes={}, preemptions=0, recomputed_tokens=0),
        _run(2, x2, 2.5, miss_causes={"activation": 1}, preemptions=3, recomputed_tokens=40),
        _run(4, [{"model": m, "ok": False} for m in "aabbc"], 2.5),
    ]
    assert subset_runs(prism_runs, ["a", "b"], slos) == [(1, 1.0), (2, 1.0), (4, 0.0)]
    static_runs = [_run(1, [{"model": m, "ok": True} for m in "aabb"], 2.0)]
    static_runs.append(_run(2, [{"model": m, "ok": m == "a"} for m in "aabb"], 2.0))
    policies = {
        "prism": {"runs": prism_runs, "sustained_scale": 1, "sustained_rate_rps": 2.5},
        "static": {
            "runs": static_runs,
            "sustained_scale": 1,
            "sustained_rate_rps": 2.0,
            "subset": {"models": ["a", "b"], "of": 3, "how": "auto"},
        },
    }
    r = ratios(policies, 0.99, slos)["prism/static"]
    # prism on the subset: x2 at the subset's base rate (2 req/s) = 4 req/s over static's 2
    assert r["on_subset"] and r["ref_scale"] == 2 and r["ratio"] == pytest.approx(2.0)
    assert ratios(policies, 0.99, None)["prism/static"]["ratio"] == pytest.approx(1.25)
    sweep = {
        "config": {"target": 0.99, "slo_source": "fixed: TTFT 1 s, TPOT 0.1 s for every model"},
        "policies": policies,
        "ratios": ratios(policies, 0.99, slos),
    }
    md = table(sweep)
    head = md.splitlines()[0]
    assert "SLOs fixed: TTFT 1 s, TPOT 0.1 s for every model" in head and "missed: causes" in head
    static_row = next(x for x in md.splitlines() if x.startswith("| static |"))
    assert "2.000 (x1) on 2 of 3 models (subset: a, b)" in static_row
    assert "| 2.00 on the subset |" in static_row
    assert "prism ÷ static is prism's sustained rate on the same requests" in md
    prism_row = next(x for x in md.splitlines() if x.startswith("| prism |"))
    assert prism_row.endswith("| none | 0 / 0 | - |")  # its x1 run: nothing missed
    # the same runs under other SLOs, from their records
    alt = slo_table(sweep, {m: {"ttft_s": 10.0, "tpot_s": 0.1} for m in "abc"}, "loose")
    assert "| prism | x1: 100.0%, x2: 80.0%, x4: 0.0% | x1: 100.0%, x2: 100.0%, x4: 100.0% |" in alt


# ---- end to end: six tiny models, a pool that holds about two ------------------------------------
def _fleet_toml(n: int = 6) -> str:
    # 256 KiB pages; a tiny model's weights take 3, its short requests' KV one: the 10-page pool
    # holds two models with room for KV (a third of the fleet), static's partition no more
    head = """
[engine]
device = "cpu"
page_bytes = 262144
pool_budget_bytes = 2621440
profile_budget_s = 0.0
"""
    models = "".join(
        f'\n[[models]]\nname = "m{i}"\nsource = "dummy:tiny-llama"\nblock_size = 4\nseed = {i}\n'
        for i in range(n)
    )
    return head + models


def _fleet_rows(n: int = 6) -> list[Row]:
    """Each model its own stream: four requests 0.5 s apart, the models 0.1 s apart."""
    rows = [
        Row(round(0.1 * i + 0.5 * k, 3), f"m{i}", 12 + 3 * k, 4) for i in range(n) for k in range(4)
    ]
    return sorted(rows, key=lambda r: r.arrival_s)


def _missed(run: dict) -> int:
    return round(len(run["requests"]) * (1 - run["report"]["overall"]["attainment"]))


@pytest.mark.slow
def test_the_capacity_sweep_adds_models_until_attainment_falls(tmp_path, capsys):
    from prism_server.bench.plots import figure_capacity
    from prism_server.bench.workload import write_csv
    from prism_server.cli.main import main

    (tmp_path / "fleet.toml").write_text(_fleet_toml())
    rows = _fleet_rows()
    write_csv(rows, tmp_path / "w.csv")
    # m5's TTFT SLO cannot be met: its 4 requests of 24 miss at n = 6 (83% >= the 80% target)
    slos = {f"m{i}": {"ttft_s": 10.0, "tpot_s": 2.0} for i in range(5)}
    slos["m5"] = {"ttft_s": 1e-6, "tpot_s": 2.0}
    (tmp_path / "slos.json").write_text(json.dumps(slos))
    out = tmp_path / "out"
    args = ["bench", "capacity", "--workload", str(tmp_path / "w.csv"), "--config"]
    args += [str(tmp_path / "fleet.toml"), "--out", str(out)]
    args += ["--start", "2", "--step", "4", "--target", "0.8", "--slo-file"]
    args += [str(tmp_path / "slos.json"), "--no-server-slos", "--settle", "0.1"]
    # one policy an invocation (as on a device, a call each): the second keeps the first's
    assert main([*args, "--policies", "static", "--no-plots"]) == 0
    first = json.loads((out / "capacity.json").read_text())["policies"]["static"]
    assert main([*args, "--policies", "prism"]) == 0
    cap = json.loads((out / "capacity.json").read_text())
    assert list(cap["policies"]) == ["prism", "static"] and cap["policies"]["static"] == first
    assert cap["config"]["counts"] == [2, 6] and cap["config"]["slo_source"] == "given"
    prism, static = cap["policies"]["prism"], cap["policies"]["static"]
    # prism serves all six on a pool that holds two, moving weights; static holds only two
    assert prism["capacity"] == 6 and static["capacity"] == 2
    assert [p["n"] for p in prism["points"]] == [2, 6] and prism["points"][1]["passed"]
    assert prism["points"][1]["run"]["activations"] > 0
    assert static["points"][1]["run"] is None and "static policy" in static["points"][1]["error"]
    for name, e in cap["policies"].items():
        for p in e["points"]:
            run = p["run"]
            if run is None:
                continue
            # each n replays its models' own rows, unchanged
            want = [r for r in rows if r.model in set(p["models"])]
            assert [(r["model"], r["arrival_s"]) for r in run["requests"]] == [
                (r.model, r.arrival_s) for r in want
            ]
            assert p["models"] == [f"m{i}" for i in range(p["n"])]
            assert sum(run["miss_causes"].values()) == _missed(run)
            assert (out / f"server-{name}-n{p['n']}.log").exists()
            # the server's log named every request: its waits, its preemptions
            assert run["logged_requests"] == len(run["requests"])
            assert all(r["waits"] is not None for r in run["requests"])
            assert run["preemptions"] == sum(r["preemptions"] for r in run["requests"])
            assert all(r["error"] is None for r in run["requests"])
    last = prism["points"][1]["run"]
    assert _missed(last) == 4 and last["report"]["models"]["m5"]["attainment"] == 0.0
    assert {r["model"] for r in last["requests"] if r["cause"]} == {"m5"}
    # m5's misses are TTFT misses: each gets the largest of its waits before its first token
    for r in last["requests"]:
        if r["cause"]:
            assert r["cause"] == max(TTFT_WAITS, key=lambda k: r["waits"][k])
    assert sum(last["miss_causes"].values()) == 4 and "unknown" not in last["miss_causes"]
    derived = tomllib.loads((out / "config-n2.toml").read_text())
    assert [m["name"] for m in derived["models"]] == ["m0", "m1"]
    md = (out / "capacity.md").read_text()
    assert "| prism | 6 | n=2: 100.0%, n=6: 83.3% |" in md
    assert "| static | 2 | n=2: 100.0%, n=6: did not start |" in md
    assert (out / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure_capacity(cap).axes[0]
    lines = {ln.get_gid(): ln for ln in ax.get_lines()}
    assert list(lines["prism"].get_xdata()) == [2, 6]
    assert list(lines["prism"].get_ydata()) == pytest.approx([100.0, 100 * 20 / 24])
    assert list(lines["prism/capacity"].get_xdata()) == [6]
    assert list(lines["static/no-start"].get_xdata()) == [6]
    assert lines["target"].get_ydata()[0] == pytest.approx(80.0)


@pytest.mark.slow
def test_static_runs_on_the_busiest_models_that_fit_and_prism_is_compared_there(tmp_path, capsys):
    from prism_server.bench.workload import write_csv
    from prism_server.cli.main import main

    (tmp_path / "fleet.toml").write_text(_fleet_toml())
    # m3 and m1 are the busiest: the pool holds two models with their KV beside
    rows = _fleet_rows()
    rows += [Row(0.05 + 0.4 * k, "m3", 10, 4) for k in range(3)]
    rows += [Row(0.25 + 0.5 * k, "m1", 10, 4) for k in range(2)]
    rows.sort(key=lambda r: r.arrival_s)
    write_csv(rows, tmp_path / "w.csv")
    out = tmp_path / "out"
    args = ["bench", "sweep", "--workload", str(tmp_path / "w.csv"), "--config"]
    args += [str(tmp_path / "fleet.toml"), "--out", str(out), "--policies", "prism,static"]
    args += ["--scales", "1", "--slo", "10,2", "--static-subset", "auto", "--settle", "0.1"]
    args += ["--no-plots"]
    assert main(args) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    cfg = sweep["config"]
    assert cfg["slo_source"] == "fixed: TTFT 10 s, TPOT 2 s for every model"
    assert cfg["slos"] == {f"m{i}": {"ttft_s": 10.0, "tpot_s": 2.0} for i in range(6)}
    prism, static = sweep["policies"]["prism"], sweep["policies"]["static"]
    # the sizes came from prism's server of the whole fleet: six models, a pool of ~10 pages
    fleet = prism["fleet"]
    assert set(fleet["models"]) == {f"m{i}" for i in range(6)}
    assert fleet["page_bytes"] == 262144 and fleet["pool_bytes"] <= 2621440
    sub = static["subset"]
    assert sub["models"] == ["m1", "m3"] and sub["of"] == 6 and sub["how"] == "auto"
    derived = tomllib.loads((out / "static-subset.toml").read_text())
    assert [m["name"] for m in derived["models"]] == ["m1", "m3"]
    assert derived["engine"] == tomllib.loads(_fleet_toml())["engine"]
    (srun,) = static["runs"]
    assert {r["model"] for r in srun["requests"]} == {"m1", "m3"}
    assert len(srun["requests"]) == sub["requests"] == sum(r.model in ("m1", "m3") for r in rows)
    (prun,) = prism["runs"]
    assert len(prun["requests"]) == len(rows) and prun["activations"] > 0
    for run in (prun, srun):
        assert sum(run["miss_causes"].values()) == _missed(run)
        assert run["logged_requests"] == len(run["requests"])
    assert (out / "requests-prism.jsonl").exists() and (out / "requests-static.jsonl").exists()
    # prism's requests of models it had to activate waited for it, in the server's account
    assert sum(r["waits"]["offloaded"] + r["waits"]["activation"] for r in prun["requests"]) > 0
    r = sweep["ratios"]["prism/static"]
    assert r["on_subset"] and r["ref_attainment"] == [[1.0, 1.0]]
    md = (out / "sweep.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| static |"))
    assert "on 2 of 6 models (subset: m1, m3)" in row and "on the subset" in row
    assert "SLOs fixed: TTFT 10 s, TPOT 2 s for every model" in md.splitlines()[0]
    # the same runs under an SLO nothing meets
    capsys.readouterr()
    assert main(["bench", "report-slo", str(out), "--slo", "0.000001,2"]) == 0
    alt = capsys.readouterr().out
    assert "| prism | x1: 100.0% | x1: 0.0% | none |" in alt


def test_bad_subsets_configs_and_slos_are_refused_before_any_server_starts(tmp_path, capsys):
    from prism_server.bench.workload import write_csv
    from prism_server.cli.main import main

    (tmp_path / "fleet.toml").write_text(_fleet_toml(3))
    (tmp_path / "kv.toml").write_text(FLEET_TOML)
    write_csv(_fleet_rows(3), tmp_path / "w.csv")
    base = ["bench", "sweep", "--workload", str(tmp_path / "w.csv"), "--out", str(tmp_path / "o")]
    sweep = [*base, "--config", str(tmp_path / "fleet.toml"), "--policies", "static"]
    assert main([*sweep, "--slo", "1,0.1", "--static-subset", "m0,nope"]) == 2
    assert "the config has no models ['nope']" in capsys.readouterr().err
    assert main([*base, "--policies", "static", "--slo", "1,0.1", "--static-subset", "auto"]) == 2
    assert "give --config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*sweep, "--slo", "1"])
    assert "TTFT_S,TPOT_S" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*sweep, "--slo", "1,0.1", "--slo-file", "x.json"])
    cap = ["bench", "capacity", "--workload", str(tmp_path / "w.csv"), "--out", str(tmp_path / "c")]
    assert main([*cap, "--config", str(tmp_path / "kv.toml"), "--slo", "1,0.1"]) == 2
    assert "set pool_budget_bytes" in capsys.readouterr().err
    assert main([*cap, "--config", str(tmp_path / "fleet.toml"), "--start", "4"]) == 2
    assert "only 3 models" in capsys.readouterr().err
