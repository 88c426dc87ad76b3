"""The bench against real servers: `GET /v1/status` and the monitor that samples it (in this
process), the standalone SLOs, and the sweep end to end (one server process per policy, the
embedded models plus tiny random ones, a tiny trace): the table and the plots are checked against
the recorded per-request data, every policy and every model present."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import urllib.request

import pytest

from prism_server.bench.monitor import state_at
from prism_server.bench.plots import (
    figure_attainment,
    figure_memory,
    figure_residency,
    figure_ttft_cdf,
)
from prism_server.bench.standalone import pick, slos_from, standalone
from prism_server.bench.sweep import expected_run_s, passed, sustained
from prism_server.bench.sweep_run import run_once
from prism_server.bench.sweep_table import busy_cell
from prism_server.bench.workload import Row, write_csv
from prism_server.cli.main import main
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread

PAGE = 64 << 10


def _server(policy: str, names="ab"):
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate(names)
    )
    cfg = EngineConfig(models=specs, device="cpu", page_bytes=PAGE, policy=policy)
    return serve_in_thread(Engine(cfg))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_status_reports_the_pool_the_models_and_their_residency_changes():
    srv = _server("swap")
    try:
        asyncio.run(
            run_once(srv.url, [Row(0.0, "a", 8, 4)], {"a": {"ttft_s": 9, "tpot_s": 9}}, 1, 1)
        )
        # its request answered, a leaves on the engine thread's next turn: read once it has
        deadline = time.monotonic() + 30
        while True:
            st = _get(srv.url + "/v1/status")
            a = next(m for m in st["devices"][0]["models"] if m["name"] == "a")
            if a["residency"] == "offloaded" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    finally:
        srv.close()
    assert st["object"] == "status" and st["policy"] == "swap" and st["failed"] == []
    (dev,) = st["devices"]
    pool = dev["pool"]
    assert pool["page_bytes"] == PAGE and pool["capacity_bytes"] == pool["capacity_pages"] * PAGE
    models = {m["name"]: m for m in dev["models"]}
    assert set(models) == {"a", "b"}
    a = models["a"]
    # swap: a ran, then left at once (nothing else queued): its timeline says so, in order
    states = [s for _, s in a["transitions"]]
    assert states[-4:] == ["activating", "resident", "draining", "offloaded"]
    times = [t for t, _ in a["transitions"]]
    assert times == sorted(times) and times[-1] <= st["time"]
    assert a["residency"] == "offloaded" and a["kv_bytes"] == 0 and a["weight_pool_bytes"] == 0
    assert a["activations"] >= 1 and a["requests_total"] == 1
    assert f'prism:model_activations_total{{model_name="a"}} {float(a["activations"])}' in metrics
    assert sum(m["pages"] for m in dev["moved"] if m["giver"] == "a") >= 1


def test_the_monitor_sees_activations_and_which_requests_waited_for_one():
    srv = _server("swap")
    rows = [Row(0.0, "a", 8, 6), Row(0.6, "b", 8, 6), Row(1.2, "a", 8, 6), Row(1.25, "a", 8, 6)]
    slos = {"a": {"ttft_s": 10.0, "tpot_s": 10.0}, "b": {"ttft_s": 10.0, "tpot_s": 10.0}}
    try:
        run = asyncio.run(run_once(srv.url, rows, slos, 1.0, len(rows) / 1.25, 0.05))
        st = _get(srv.url + "/v1/status")
    finally:
        srv.close()
    acts = sum(m["activations"] for m in st["devices"][0]["models"])
    assert run["activations"] == acts >= 3 and run["evictions"] >= 2
    reqs = run["requests"]
    assert [r["tokens"] for r in reqs] == [6] * 4 and all(r["error"] is None for r in reqs)
    # the first three found their model offloaded (swap evicts at once); each that waited is
    # one the timeline shows not resident at its send time
    assert all(r["waited_activation"] for r in reqs[:3])
    for r in reqs:
        state = state_at([tuple(x) for x in run["transitions"][r["model"]]], r["sent_s"])
        assert r["waited_activation"] == (state != "resident")
    aw = run["activation_wait"]
    assert aw["requests"] == sum(r["waited_activation"] for r in reqs)
    assert aw["ttft_p99_s"] == max(r["ttft_s"] for r in reqs if r["waited_activation"])
    assert run["samples"] and set(run["samples"][-1]["models"]) == {"a", "b"}
    assert run["report"]["overall"]["attainment"] == 1.0 and passed(run, 0.99)
    # the engine's counters: a step per token of each batch at least (one model a step; the
    # last two requests, 50 ms apart, may share their steps), and the time in steps and between
    # them a part of the run's
    eng = st["devices"][0]["engine"]
    (seen,) = run["engine"].values()
    assert eng["steps"] >= 3 * 6 and 1 <= seen["steps"] <= eng["steps"]
    assert 0 < seen["busy"] <= 1 and 0 <= seen["host"] <= 1 and seen["busy"] + seen["host"] <= 1
    assert seen["host_per_step_s"] is not None and seen["host_per_step_s"] < 0.05
    assert 0 < seen["step_seconds"] <= eng["step_seconds"]
    cell = busy_cell(run)  # the busy fraction and the busy seconds per 1,000 requests served
    per_1k = 1000 * seen["step_seconds"] / run["report"]["overall"]["requests"]
    assert cell == f"{100 * seen['busy']:.0f}% ({per_1k:.1f} s / 1k req)"
    assert eng["step_seconds"] > 0 and 0 <= eng["step_overhead_s"] < 0.05


def test_a_run_stopped_early_records_when_and_its_bound_and_the_table_shows_it():
    from prism_server.bench.sweep_table import table

    srv = _server("prism")
    rows = [Row(0.0, "a", 8, 4), Row(0.2, "b", 8, 4)] + [Row(20.0 + i, "a", 8, 4) for i in range(8)]
    slos = {"a": {"ttft_s": 10.0, "tpot_s": 10.0}, "b": {"ttft_s": 0.0, "tpot_s": 10.0}}
    try:
        run = asyncio.run(run_once(srv.url, rows, slos, 1.0, 0.5, 0.05, stop_below=0.99))
        full = asyncio.run(run_once(srv.url, rows[:2], slos, 1.0, 0.5, 0.05, stop_below=None))
    finally:
        srv.close()
    st = run["stopped_early"]
    assert st["missed"] == 1 and st["at_s"] < 10 and run["duration_s"] == st["at_s"]
    assert st["sent"] == sum(r["sent_s"] > 0 for r in run["requests"]) == 2
    assert st["attainment_at_most"] == 1 - 1 / 10 and not passed(run, 0.99)
    assert full["stopped_early"] is None and full["report"]["overall"]["attainment"] == 0.5
    sweep = {
        "config": {"target": 0.99},
        "policies": {"static": {"runs": [run], "sustained_scale": None}},
        "ratios": {},
    }
    assert f"x1: <= 90.0% (stopped at {st['at_s']:.0f} s, 1 missed)" in table(sweep)


def test_standalone_sets_each_slo_to_k_times_the_p99():
    srv = _server("prism")
    rows = [Row(0.1 * i, "ab"[i % 2], 6 + i, 3 + i % 3) for i in range(8)]
    try:
        alone = asyncio.run(standalone(srv.url, rows, per_model=3, max_output=2))
    finally:
        srv.close()
    assert set(alone) == {"a", "b"} and all(
        m["requests"] == 3 and not m["errors"] for m in alone.values()
    )
    slos = slos_from(alone, 5.0)
    for model, m in alone.items():
        assert slos[model] == {"ttft_s": 5 * m["ttft_p99_s"], "tpot_s": 5 * m["tpot_p99_s"]}
    by_len = [Row(0.0, "a", n, 9) for n in (50, 10, 30, 20, 40)]
    assert [r.prompt_len for r in pick(by_len, 3)] == [10, 30, 50]
    assert [r.prompt_len for r in pick(by_len[:2], 5)] == [10, 50]


def test_sustained_is_the_last_pass_below_every_failure():
    def run(scale, att):
        return {"scale": scale, "report": {"overall": {"attainment": att}}}

    runs = [run(1, 1.0), run(2, 0.995), run(4, 0.9), run(8, 1.0)]  # a lucky pass above a failure
    assert sustained(runs, 0.99)["scale"] == 2
    assert sustained([run(1, 0.5)], 0.99) is None


CONFIG = """
[engine]
device = "cpu"
page_bytes = 1048576
kv_budget_bytes = 33554432
profile_budget_s = 0.0

[[models]]
name = "tiny-c"
source = "dummy:tiny-llama"
block_size = 4
seed = 2

[[models]]
name = "tiny-d"
source = "dummy:tiny-llama"
block_size = 4
seed = 3

[[models]]
name = "tiny-a"
source = "dummy:tiny-llama"
block_size = 4

[[models]]
name = "tiny-b"
source = "dummy:tiny-llama"
block_size = 4
seed = 1
"""
MODELS = ["tiny-a", "tiny-b", "tiny-c", "tiny-d"]


@pytest.mark.slow
def test_the_sweep_runs_every_policy_and_its_table_and_plots_are_the_data(tmp_path, capsys):
    (tmp_path / "prism.toml").write_text(CONFIG)
    rows = [Row(0.25 * i, MODELS[(i // 2) % 4], 12 + 5 * (i % 3), 3 + i % 2) for i in range(12)]
    write_csv(rows, tmp_path / "w.csv")
    out = tmp_path / "out"
    args = ["bench", "sweep", "--workload", str(tmp_path / "w.csv"), "--config"]
    args += [str(tmp_path / "prism.toml"), "--out", str(out), "--scales", "1,2"]
    args += ["--keep-going", "1", "--standalone-requests", "2", "--settle", "0.2"]
    assert main(args) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert list(sweep["policies"]) == ["prism", "static", "swap"]
    cfg = sweep["config"]
    assert cfg["models"] == MODELS and cfg["slo_source"] == "standalone x 5"
    # the SLOs are k x the standalone p99, written into the run's config
    for model, m in sweep["standalone"].items():
        assert cfg["slos"][model]["ttft_s"] == pytest.approx(5 * m["ttft_p99_s"])
    md = (out / "sweep.md").read_text()
    for name, p in sweep["policies"].items():
        assert p["server_exit"] == 0 and (out / f"server-{name}.log").exists()
        assert [r["scale"] for r in p["runs"]] == [1.0, 2.0]  # keep-going: both ran
        for run in p["runs"]:
            reqs = run["requests"]
            assert len(reqs) == len(rows) and {r["model"] for r in reqs} == set(MODELS)
            assert all(r["error"] is None and r["tokens"] == r["output_len"] for r in reqs)
            # the report is the per-request records under the config's SLOs
            slo = cfg["slos"]
            met = [
                r["ttft_s"] <= slo[r["model"]]["ttft_s"]
                and (r["tpot_s"] is None or r["tpot_s"] <= slo[r["model"]]["tpot_s"])
                for r in reqs
            ]
            assert run["report"]["overall"]["attainment"] == pytest.approx(sum(met) / len(met))
            # the server's request log, joined by response id: every request's line, and each
            # missed request's cause, exactly the misses
            assert run["logged_requests"] == len(reqs) and all(r["id"] for r in reqs)
            assert [r["cause"] is not None for r in reqs] == [not m for m in met]
            assert sum(run["miss_causes"].values()) == len(met) - sum(met)
            assert run["preemptions"] == sum(r["preemptions"] for r in reqs)
            assert set(run["report"]["models"]) == set(MODELS)
            assert run["rate_rps"] == pytest.approx(cfg["base_rate_rps"] * run["scale"])
            assert {m for s in run["samples"] for m in s["models"]} == set(MODELS)
            line = f"x{run['scale']:g}: {100 * run['report']['overall']['attainment']:.1f}%"
            assert line in md
        best = sustained(p["runs"], 0.99)
        assert p["sustained_scale"] == (best["scale"] if best else None)
        row = next(x for x in md.splitlines() if x.startswith(f"| {name} |"))
        assert (f"(x{best['scale']:g})" in row) if best else ("| none |" in row)
    # every run recorded each model's measured step costs; the simulator replays them
    for name in ("prism", "static"):
        for run in sweep["policies"][name]["runs"]:
            assert set(run["latency"]) == set(MODELS)
            assert all(len(v["coefficients"]) == 6 for v in run["latency"].values())
            assert all(v["kv_blocks_capacity"] > 0 for v in run["latency"].values())
    capsys.readouterr()
    assert main(["bench", "simulate", str(out), "--scales", "8"]) == 0
    table = capsys.readouterr().out
    for run in sweep["policies"]["prism"]["runs"]:
        o = run["report"]["overall"]
        assert f"| x{run['scale']:g} |" in table and f"{100 * o['attainment']:.1f}%" in table
    assert "| x8 |" in table and "not run" in table
    assert main(["bench", "simulate", str(out), "--policy", "static"]) == 0
    # an archived run (sweep.json gzipped) replays the same
    capsys.readouterr()
    archived = tmp_path / "archived"
    archived.mkdir()
    (archived / "sweep.json.gz").write_bytes(gzip.compress((out / "sweep.json").read_bytes()))
    assert main(["bench", "simulate", str(archived), "--scales", "8"]) == 0
    assert capsys.readouterr().out == table
    with pytest.raises(SystemExit, match="no sweep.json"):
        main(["bench", "simulate", str(tmp_path / "nowhere")])
    # static keeps every model resident for good; swap activated something
    static_run = sweep["policies"]["static"]["runs"][0]
    assert static_run["activations"] == 0
    assert all(tl[-1][1] == "resident" for tl in static_run["transitions"].values())
    assert sum(r["activations"] for r in sweep["policies"]["swap"]["runs"]) > 0
    for model in MODELS:
        assert f"| {model} |" in md
    # the plots: written, and their artists carry the sweep's numbers
    for name in ("attainment", "memory", "ttft_cdf", "residency"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {ln.get_label(): ln for ln in figure_attainment(sweep).axes[0].get_lines()}
    for name, p in sweep["policies"].items():
        assert list(lines[name].get_ydata()) == pytest.approx(
            [100 * r["report"]["overall"]["attainment"] for r in p["runs"]]
        )
    cdf = {ln.get_label() for ax in figure_ttft_cdf(sweep).axes for ln in ax.get_lines()}
    assert {"prism", "static", "swap"} <= cdf
    labels = {
        h.get_label() for ax in figure_memory(sweep).axes for h in ax.collections + ax.patches
    }
    assert {f"{m} weights" for m in MODELS} <= labels
    gids = {c.get_gid() for ax in figure_residency(sweep).axes for c in ax.collections}
    assert {f"static/{m}/resident" for m in MODELS} <= gids
    # a later call for one policy (the GPU runs one per call) adds its runs to that policy's and
    # keeps the others' and the SLOs: a scale run again replaces its earlier run
    again = ["bench", "sweep", "--workload", str(tmp_path / "w.csv"), "--config"]
    again += [str(tmp_path / "prism.toml"), "--out", str(out), "--policies", "prism"]
    assert main([*again, "--scales", "2,4", "--keep-going", "1", "--settle", "0.2"]) == 0
    merged = json.loads((out / "sweep.json").read_text())
    assert (
        merged["config"]["slos"] == cfg["slos"]
        and merged["config"]["slo_source"] == "standalone x 5"
    )
    runs = merged["policies"]["prism"]["runs"]
    assert [r["scale"] for r in runs] == [1.0, 2.0, 4.0]
    assert runs[0] == sweep["policies"]["prism"]["runs"][0]
    assert runs[1]["requests"] != sweep["policies"]["prism"]["runs"][1]["requests"]  # re-run
    assert merged["policies"]["static"] == sweep["policies"]["static"]
    assert "x4: " in next(
        x for x in (out / "sweep.md").read_text().splitlines() if x.startswith("| prism |")
    )


def test_the_time_budget_expects_a_run_to_span_its_arrivals_plus_the_drain_seen():
    # 60 s of arrivals at x1: x0.25 spans 240 s; it took 245 s, so x0.5 should take 120 + 5 + 10
    assert expected_run_s(60.0, 0.25, []) == pytest.approx(250.0)
    runs = [{"scale": 0.25, "duration_s": 245.0}]
    assert expected_run_s(60.0, 0.5, runs) == pytest.approx(135.0)
    runs.append({"scale": 0.5, "duration_s": 150.0})  # a slow drain: 30 s past the last arrival
    assert expected_run_s(60.0, 1.0, runs) == pytest.approx(100.0)


def test_the_simulator_replays_a_run_with_its_measured_step_costs():
    """A run record's step costs and the sweep's SLOs go into the simulator as they are: its
    prediction is the simulator's own on the same models, and beside it the measurement."""
    from prism_server.bench.simulate import predict, sim_models, simulate_sweep
    from scheduler.latency_model import LatencyModel
    from scheduler.simulator import SimArrival, SimModel, simulate

    coeffs = {"a": [4e-3, 3e-5, 1e-5, 1e-6], "b": [2e-3, 1e-5, 1e-5, 1e-6]}
    latency = {m: {"coefficients": c, "kv_blocks_capacity": 64} for m, c in coeffs.items()}
    slos = {"a": {"ttft_s": 0.05, "tpot_s": 0.01}, "b": {"ttft_s": 0.02, "tpot_s": 0.004}}
    rows = [Row(0.01 * i, "ab"[i % 2], 100 + 40 * (i % 5), 8) for i in range(40)]

    def slos_of(m):
        return {"ttft_slo_s": slos[m]["ttft_s"], "tpot_slo_s": slos[m]["tpot_s"]}

    overall = {"attainment": 0.5, "ttft_attainment": 0.6, "tpot_attainment": 0.7}
    run = {
        "scale": 2.0,
        "latency": latency,
        "report": {"overall": overall},
        "engine": {"cpu": {"busy": 0.4, "host_per_step_s": 2e-4}},
    }
    sweep = {"config": {"slos": slos}, "policies": {"prism": {"runs": [run]}}}
    got = simulate_sweep(sweep, rows, "prism", scales=[2.0, 4.0])  # 2.0 ran: not again
    assert [p["scale"] for p in got] == [2.0, 4.0]
    assert got[0]["measured"] == {**overall, "busy": 0.4} and "measured" not in got[1]
    cfg = sim_models(latency, slos)[0].config
    models = [SimModel(m, LatencyModel(coeffs[m]), **slos_of(m), config=cfg) for m in "ab"]
    arrivals = [SimArrival(r.arrival_s / 2, r.model, r.prompt_len, r.output_len) for r in rows]
    direct = simulate(models, arrivals, 2e-4)
    assert got[0]["attainment"] == pytest.approx(direct.attainment())
    # static: the same arbitrator over each model's recorded KV quota (64 blocks of 16 here)
    assert all(m.kv_blocks == 64 for m in sim_models(latency, slos, "static"))
    assert predict(rows, sim_models(latency, slos, "static"), 2.0)["attainment"] <= 1.0
    with pytest.raises(ValueError, match="replays"):
        sim_models(latency, slos, "swap")
    with pytest.raises(ValueError, match="step costs"):
        simulate_sweep({"config": {"slos": slos}, "policies": {"prism": {"runs": [{}]}}}, rows)


def test_step_costs_fitted_to_a_step_trace_replace_the_runs_online_fits(tmp_path):
    import gzip

    from prism_server.bench.simulate import fit_step_trace, with_step_costs
    from scheduler.latency_model import StepShape

    true = {"a": (4e-3, 3e-5, 1e-5, 1e-6, 3e-5, 1e-2), "b": (2e-3, 1e-5, 1e-5, 5e-7, 2e-5, 5e-3)}
    lines = []
    for model, coef in true.items():
        for i in range(60):
            if i % 3 == 0:  # a chunk of a long prompt, alone
                shape = StepShape.prefill(256 * (1 + i % 8), 512 * (i % 4))
            else:
                shape = StepShape.decode(1 + i % 7, (1 + i % 7) * 300 * (1 + i % 5))
            t = sum(c * f for c, f in zip(coef, shape.features()))
            rec = {"t": float(i), "s": t, "model": model, "run_s": t, "tokens": shape.tokens}
            rec |= {"seqs": shape.seqs, "kv": shape.kv}
            if model == "a":
                rec["attn"] = shape.attn  # b's trace predates it: read back from its shape
            lines.append(json.dumps(rec) + "\n")
    trace = tmp_path / "steps.jsonl.gz"
    with gzip.open(trace, "wt") as f:
        f.writelines(lines)
    got = fit_step_trace(trace)
    for model, coef in true.items():
        assert got[model] == pytest.approx(coef, rel=1e-3, abs=1e-9)
    latency = {m: {"coefficients": [1.0] * 4, "kv_blocks_capacity": 8} for m in true}
    sweep = {"policies": {"prism": {"runs": [{"scale": 1.0, "latency": latency}]}}}
    costs = with_step_costs(sweep, got)["policies"]["prism"]["runs"][0]["latency"]
    assert {m: v["coefficients"] for m, v in costs.items()} == got
    assert latency["a"]["coefficients"] == [1.0] * 4  # the sweep given is left as it was


def test_step_noise_is_drawn_from_the_traces_own_scatter(tmp_path):
    """Each step of a trace as measured / fitted, by model and kind; a seeded draw from the
    right pool (every model's where one has none); noisy predictions are a mean with its worst."""
    import gzip

    from prism_server.bench.simulate import noise_from, predict, sim_models, step_ratios
    from scheduler.latency_model import LatencyModel, StepShape

    coef = [4e-3, 3e-5, 1e-5, 1e-6, 3e-5, 1e-2]
    lm = LatencyModel(tuple(coef))
    lines = []
    for i in range(40):
        prefill = i % 2 == 0
        shape = StepShape.prefill(128 + i, 64) if prefill else StepShape.decode(1 + i % 5, 900)
        ratio = (1.5 if i % 4 == 0 else 2.0) if prefill else 1.0
        t = lm.estimate(shape) * ratio
        rec = {"t": float(i), "s": t, "model": "a", "run_s": t, "tokens": shape.tokens}
        lines.append(json.dumps(rec | {"seqs": shape.seqs, "kv": shape.kv, "attn": shape.attn}))
    trace = tmp_path / "steps.jsonl.gz"
    with gzip.open(trace, "wt") as f:
        f.write("\n".join(lines) + "\n")
    ratios = step_ratios(trace, {"a": coef})
    assert sorted(set(ratios["a"]["prefill"])) == pytest.approx([1.5, 2.0])
    assert ratios["a"]["decode"] == pytest.approx([1.0] * 20) and ratios["*"] == ratios["a"]
    draw = noise_from(ratios, seed=3)
    seen = [draw("a", StepShape.prefill(100)) for _ in range(200)]
    assert sorted({round(x, 9) for x in seen}) == [1.5, 2.0]
    assert draw("other", StepShape.decode(2, 100)) == pytest.approx(1.0)  # the pooled ratios
    again = noise_from(ratios, seed=3)
    assert [again("a", StepShape.prefill(100)) for _ in range(200)] == seen
    latency = {"a": {"coefficients": coef, "kv_blocks_capacity": 64}}
    slos = {"a": {"ttft_s": 0.05, "tpot_s": 0.02}}
    rows = [Row(0.1 * i, "a", 300, 6) for i in range(30)]
    models = sim_models(latency, slos)
    calm = predict(rows, models, 1.0)
    noisy = predict(rows, models, 1.0, ratios=ratios, seeds=4)
    assert noisy["attainment_min"] <= noisy["attainment"] <= calm["attainment"]
    assert noisy["busy"] > calm["busy"]  # prefill steps last 1.5-2x their fit
