"""Bench workloads: the CSV round trip, scaling, the Azure converter on the real trace, the
synthetic generator's burstiness, shifting groups and idle models, and the activity statistics
(idle models per minute, active-set changes per hour) on the trace's own time."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from prism_server.bench.workload import (
    Row,
    active_sets,
    activity,
    bursty_groups,
    clamp_lengths,
    from_azure,
    read_csv,
    resample_lengths,
    scale_rate,
    window,
    write_csv,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure_llm_2023"


def test_csv_round_trip_and_bad_rows(tmp_path):
    rows = [Row(0.5, "a", 10, 5), Row(0.1, "b", 3, 7)]
    write_csv(rows, tmp_path / "w.csv")
    assert read_csv(tmp_path / "w.csv") == sorted(rows, key=lambda r: r.arrival_s)
    (tmp_path / "bad.csv").write_text("arrival_s,model,prompt_len,output_len\n1.0,a,0,5\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        read_csv(tmp_path / "bad.csv")
    (tmp_path / "cols.csv").write_text("arrival_s,model\n1.0,a\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_csv(tmp_path / "cols.csv")


def test_rate_scaling_window_and_clamping():
    rows = [Row(float(i), "a", 100 * i + 1, 50) for i in range(10)]
    fast = scale_rate(rows, 2.0)
    assert [r.arrival_s for r in fast] == [i / 2 for i in range(10)]
    assert [r.arrival_s for r in window(rows, 3.0, 6.0)] == [0.0, 1.0, 2.0]
    assert max(r.prompt_len for r in clamp_lengths(rows, 256, 8)) == 256


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces are not beside the checkout")
def test_the_azure_trace_becomes_two_models_rows():
    rows = from_azure(
        {
            "code": TRACES / "AzureLLMInferenceTrace_code.csv.gz",
            "conv": TRACES / "AzureLLMInferenceTrace_conv.csv.gz",
        },
        limit_s=600,
    )
    assert {r.model for r in rows} == {"code", "conv"}
    assert rows[0].arrival_s == 0.0 and all(r.arrival_s < 600 for r in rows)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:]))
    code = [r.prompt_len for r in rows if r.model == "code"]
    assert statistics.median(code) > 500  # code requests carry long contexts


def test_bursty_groups_are_bursty_shifting_and_mostly_idle():
    models = [f"m{i}" for i in range(12)]
    rows = bursty_groups(models, duration_s=3600, rate=5.0, shifts_per_hour=6, cv=2.0, seed=1)
    assert abs(len(rows) / 3600 - 5.0) < 0.75
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(rows, rows[1:])]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv > 1.5  # bursty, not Poisson (CV 1)
    groups = [{r.model for r in rows if k * 600 <= r.arrival_s < (k + 1) * 600} for k in range(6)]
    assert all(len(g) <= 4 for g in groups)  # 35% of 12 active at a time
    assert len(set().union(*groups)) > 4  # the group shifts
    assert 0.5 <= activity(rows, models, window_s=600).idle_mean <= 0.77
    assert rows == bursty_groups(models, 3600, 5.0, 6, cv=2.0, seed=1)  # deterministic


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces are not beside the checkout")
def test_the_workload_command_writes_what_the_converters_give(tmp_path, capsys):
    from prism_server.bench.traces import from_mooncake, from_servegen
    from prism_server.cli.main import main

    root = TRACES.parent
    out = tmp_path / "sg.csv"
    streams = "m-large/c7,m-mid/c3"
    args = ["bench", "workload", "--source", "servegen", "--models", "x,y", "--out", str(out)]
    args += ["--traces", str(root), "--duration-s", "1800", "--rate-scale", "0.001"]
    args += ["--servegen-streams", streams, "--seed", "4", "--time-scale", "0.1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "x <- m-large/c7" in text and "y <- m-mid/c3" in text
    want = from_servegen(
        ["x", "y"],
        duration_s=1800,
        rate_scale=0.001,
        seed=4,
        window_scale=0.1,
        streams=streams.split(","),
        root=root / "servegen",
    )
    got = read_csv(out)
    assert len(got) == len(want) > 0
    # the activity it prints is on the trace's own minutes: the 30 of the window, not 3
    act = activity(got, ["x", "y"], 60.0, 0.1, 1800)
    assert "(1800 s, 30 minutes)" in text and act.windows == 30
    assert f"models idle per minute {100 * act.idle_mean:.0f}%" in text
    assert f"active set changes per hour: {act.changes_per_hour:.0f}" in text
    assert all(
        (a.model, a.prompt_len, a.output_len) == (b.model, b.prompt_len, b.output_len)
        and abs(a.arrival_s - b.arrival_s) < 1e-5
        for a, b in zip(got, want)
    )
    args = ["bench", "workload", "--source", "mooncake", "--models", "p,q", "--out", str(out)]
    args += ["--traces", str(root), "--duration-s", "120", "--max-prompt", "4096"]
    assert main(args) == 0
    rows = read_csv(out)
    full = [
        r
        for r in from_mooncake(
            ["p", "q"], root / "mooncake_fast25" / "conversation_trace.jsonl.gz", limit_s=120
        )
    ]
    assert len(rows) == len(full) and max(r.prompt_len for r in rows) <= 4096
    bad = ["bench", "workload", "--source", "azure", "--models", "one", "--out", str(out)]
    assert main(bad + ["--traces", str(root)]) == 2
    assert "two models" in capsys.readouterr().err


def test_the_bursty_command_takes_length_ranges(tmp_path):
    from prism_server.cli.main import main

    out = tmp_path / "b.csv"
    args = ["bench", "workload", "--source", "bursty", "--models", "a,b,c,d", "--out", str(out)]
    args += ["--duration-s", "300", "--rate", "2", "--prompt-range", "1024,8192"]
    args += ["--output-range", "64,512", "--seed", "3"]
    assert main(args) == 0
    rows = read_csv(out)
    want = bursty_groups(
        ["a", "b", "c", "d"], 300, 2.0, prompt_len=(1024, 8192), output_len=(64, 512), seed=3
    )
    assert rows and [(r.model, r.prompt_len, r.output_len) for r in rows] == [
        (r.model, r.prompt_len, r.output_len) for r in want
    ]
    assert [r.arrival_s for r in rows] == pytest.approx([r.arrival_s for r in want], abs=1e-5)
    assert all(1024 <= r.prompt_len <= 8192 and 64 <= r.output_len <= 512 for r in rows)
    with pytest.raises(SystemExit):
        main(
            [
                "bench",
                "workload",
                "--source",
                "bursty",
                "--models",
                "a",
                "--out",
                str(out),
                "--prompt-range",
                "9,3",
            ]
        )


def test_lengths_drawn_from_another_trace_keep_the_arrivals_and_pair_the_lengths():
    rows = [Row(0.1 * i, "ab"[i % 2], 10, 5) for i in range(400)]
    pairs = [(100, 7), (2000, 300), (6000, 40)]
    out = resample_lengths(rows, pairs, seed=1)
    assert [(r.arrival_s, r.model) for r in out] == [(r.arrival_s, r.model) for r in rows]
    drawn = [(r.prompt_len, r.output_len) for r in out]
    assert set(drawn) == set(pairs)  # whole pairs, every one of them drawn
    assert all(drawn.count(p) > 80 for p in pairs)  # with replacement, about evenly
    assert resample_lengths(rows, pairs, seed=1) == out
    assert resample_lengths(rows, pairs, seed=2) != out
    with pytest.raises(ValueError):
        resample_lengths(rows, [])


@pytest.mark.skipif(
    not (TRACES.parent / "servegen").exists() or not (TRACES.parent / "mooncake_fast25").exists(),
    reason="the shared traces are not beside the checkout",
)
def test_the_workload_command_takes_a_servegen_stream_with_mooncake_lengths(tmp_path, capsys):
    from prism_server.bench.traces import from_servegen
    from prism_server.bench.traces_cli import length_pairs
    from prism_server.cli.main import main

    root = TRACES.parent
    out = tmp_path / "mix.csv"
    args = ["bench", "workload", "--source", "servegen", "--models", "x,y", "--out", str(out)]
    args += ["--traces", str(root), "--servegen-models", "m-mid", "--duration-s", "1800"]
    args += ["--rate-scale", "0.0001", "--lengths", "mooncake", "--max-prompt", "6144"]
    args += ["--max-output", "128"]
    assert main(args) == 0
    assert "lengths from mooncake" in capsys.readouterr().out
    arrivals = from_servegen(
        ["x", "y"],
        duration_s=1800,
        rate_scale=0.0001,
        source_models=["m-mid"],
        root=root / "servegen",
    )
    rows = read_csv(out)
    assert len(rows) == len(arrivals) > 20
    assert [(r.model, round(r.arrival_s, 4)) for r in rows] == [
        (r.model, round(r.arrival_s, 4)) for r in arrivals
    ]
    moon = length_pairs("mooncake", root)
    capped = {(min(p, 6144), min(o, 128)) for p, o in moon}
    assert all((r.prompt_len, r.output_len) in capped for r in rows)
    # Mooncake's prompts are long: most hit the cap, unlike ServeGen's own
    assert statistics.median(r.prompt_len for r in rows) > 3000
    assert statistics.median(r.prompt_len for r in arrivals) < 2000
    azure = length_pairs("azure-code", root)
    assert len(azure) == 8819 and statistics.mean(o for _, o in azure) < 40


def _minutes(spec: dict[str, list[int]], time_scale: float = 1.0) -> list[Row]:
    """Rows from model -> the minutes of trace time it has a request in (at mid-minute)."""
    rows = [Row((60 * m + 30) * time_scale, name, 10, 5) for name, ms in spec.items() for m in ms]
    return sorted(rows, key=lambda r: r.arrival_s)


def test_active_sets_and_changes_per_hour_on_hand_made_rows():
    models = ["a", "b", "c", "d"]
    # minute:   0      1      2      3
    # active: {a,b}  {a,c}   {}   {a,b,c}   (d never)
    rows = _minutes({"a": [0, 1, 3], "b": [0, 3], "c": [1, 3]})
    rows.append(Row(61.0, "a", 10, 5))  # a second request in a window changes nothing
    rows.append(Row(65.0, "other", 10, 5))  # a model not named is not counted
    sets = active_sets(rows, models)
    assert sets == [{"a", "b"}, {"a", "c"}, set(), {"a", "b", "c"}]
    act = activity(rows, models)
    # changes: 0->1: b idle, c active (2); 1->2: a, c idle (2); 2->3: a, b, c active (3)
    assert act.windows == 4 and act.changes == 7
    assert act.changes_per_hour == pytest.approx(7 * 60 / 3)  # 3 transitions of one minute
    idle = [0.5, 0.5, 1.0, 0.25]
    assert act.idle_mean == pytest.approx(sum(idle) / 4)
    assert (act.idle_min, act.idle_max) == (0.25, 1.0)


def test_activity_is_measured_on_the_trace_time_before_compression():
    models = ["a", "b", "c"]
    spec = {"a": [0, 2, 4], "b": [1, 2], "c": [5]}
    trace = activity(_minutes(spec), models)
    # the same requests compressed 60x: one trace minute is a second of replay
    fast = _minutes(spec, time_scale=1 / 60)
    assert activity(fast, models, time_scale=1 / 60) == trace
    # {a} {b} {a,b} {} {a} {c}: 2 + 1 + 2 + 1 + 2 changes
    assert trace.windows == 6 and trace.changes == 8
    # read as if uncompressed, all of it is one window: nothing would change
    assert activity(fast, models).windows == 1 and activity(fast, models).changes_per_hour is None
    # a span past the last arrival adds idle minutes (a trailing one: c goes idle); one shorter
    # leaves the later requests out
    longer = activity(_minutes(spec), models, span_s=420)
    assert longer.windows == 7 and longer.changes == trace.changes + 1
    assert longer.idle_max == 1.0
    assert active_sets(_minutes(spec), models, span_s=120) == [{"a"}, {"b"}]
    # wider windows: two minutes each
    assert active_sets(_minutes(spec), models, window_s=120) == [{"a", "b"}, {"a", "b"}, {"a", "c"}]


def test_activity_rejects_bad_arguments():
    rows = [Row(0.0, "a", 1, 1)]
    for kw in ({"window_s": 0}, {"time_scale": -1.0}, {"span_s": 0.0}):
        with pytest.raises(ValueError):
            activity(rows, ["a"], **kw)
    with pytest.raises(ValueError):
        activity(rows, [])
    assert activity([], ["a"]).idle_mean == 1.0  # no request: every model idle
