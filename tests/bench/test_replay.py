"""A replay against a real server in this process (two tiny models): every request streams its
exact output length, and the report's numbers are those of the recorded per-request data."""

from __future__ import annotations

import asyncio

from prism_server.bench.replay import prompt_ids, replay
from prism_server.bench.report import markdown, percentile, report
from prism_server.bench.workload import Row
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread


def test_replay_records_every_token_and_the_report_agrees():
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate("ab")
    )
    rows = [Row(0.02 * i, "ab"[i % 2], 5 + 3 * i, 4 + i % 5) for i in range(12)]
    rows.append(Row(0.3, "nope", 5, 4))  # an unknown model: 404, counted as an error
    srv = serve_in_thread(Engine(EngineConfig(models=specs, device="cpu", page_bytes=64 << 10)))
    try:
        results = asyncio.run(replay(srv.url, rows))
    finally:
        srv.close()  # the engine too
    good = results[:-1]
    assert all(r.ok and r.tokens == r.row.output_len for r in good), [r.error for r in good]
    assert all(r.ttft > 0 and len(r.token_times) == r.row.output_len for r in good)
    assert results[-1].status == 404 and not results[-1].ok
    slos = {"a": (10.0, 1.0), "b": (10.0, 1.0), "nope": (1.0, 1.0)}
    rep = report(results, slos, span_s=1.0)
    assert rep["models"]["a"]["requests"] == 6 and rep["models"]["a"]["attainment"] == 1.0
    assert rep["overall"]["errors"] == 1 and abs(rep["overall"]["attainment"] - 12 / 13) < 1e-9
    ttfts = sorted(r.ttft for r in good if r.row.model == "b")
    assert rep["models"]["b"]["ttft_p50_s"] == percentile(ttfts, 50)
    assert rep["models"]["b"]["ttft_p99_s"] == ttfts[-1]
    tight = report(results, {**slos, "a": (0.0, 1.0)}, span_s=1.0)  # no TTFT can meet 0 s
    assert tight["models"]["a"]["ttft_attainment"] == 0.0
    table = markdown(rep)
    assert "| a | 6 | 0 | 100.0%" in table and "| all | 13 | 1 |" in table


def test_the_bench_command_writes_the_table(tmp_path, capsys):
    from prism_server.bench.workload import write_csv
    from prism_server.cli.main import main

    specs = (ModelSpec("a", "dummy:tiny-llama", block_size=4),)
    write_csv([Row(0.01 * i, "a", 6, 3) for i in range(4)], tmp_path / "w.csv")
    srv = serve_in_thread(Engine(EngineConfig(models=specs, device="cpu", page_bytes=64 << 10)))
    try:
        rc = main(
            [
                "bench",
                "run",
                "--url",
                srv.url,
                "--workload",
                str(tmp_path / "w.csv"),
                "--json",
                str(tmp_path / "r.json"),
                "--markdown",
                str(tmp_path / "r.md"),
            ]
        )
    finally:
        srv.close()
    assert rc == 0
    import json

    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["models"]["a"]["requests"] == 4 and rep["overall"]["errors"] == 0
    assert "| a | 4 | 0 |" in (tmp_path / "r.md").read_text()
    assert main(["bench", "run", "--workload", str(tmp_path / "missing.csv")]) == 2
    recs = rep["requests"]
    assert [r["tokens"] for r in recs] == [3] * 4 and all(len(r["gaps_s"]) == 2 for r in recs)


def test_prompts_are_exact_in_length_and_share_no_prefix_across_requests():
    """A prefix cache must find nothing between two requests of a run (it would flatter every
    policy alike): the first 16-token block differs for every request, here over 2,000."""
    rows = [Row(0.0, "m", 16 + i % 300, 4) for i in range(2000)]
    prompts = [prompt_ids(r, i) for i, r in enumerate(rows)]
    assert [len(p) for p in prompts] == [r.prompt_len for r in rows]
    assert all(10 <= t < 256 for p in prompts for t in p)
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)
    assert prompt_ids(Row(0.0, "m", 1, 4), 5) == [10]  # a one-token prompt still works


def test_a_replay_stops_once_the_target_is_out_of_reach_and_the_server_loses_nothing():
    """One miss is more than 99% of 4 requests allows: the replay ends at once, the stream in
    flight is cancelled (the server aborts it and frees its KV), the later rows are not sent,
    and the server keeps serving."""
    from prism_server.bench.replay import STOPPED, EarlyStop, allowed_misses
    from prism_server.bench.server_process import wait_quiet

    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, seed=i) for i, n in enumerate("ab")
    )
    rows = [
        Row(0.0, "b", 8, 2000),
        Row(0.05, "a", 6, 4),
        Row(30.0, "a", 6, 4),
        Row(30.0, "b", 6, 4),
    ]
    assert allowed_misses(len(rows), 0.99) == 0 and allowed_misses(200, 0.99) == 2
    stop = EarlyStop({"a": (0.0, 1.0), "b": (60.0, 1.0)}, misses=0)  # no TTFT of a meets 0 s
    srv = serve_in_thread(Engine(EngineConfig(models=specs, device="cpu", page_bytes=64 << 10)))
    try:
        results = asyncio.run(replay(srv.url, rows, stop=stop))
        assert stop.at_s is not None and stop.at_s < 10 and stop.missed == 1
        long, late_a = results[0], results[1]
        assert long.error == STOPPED and 0 < long.tokens < 2000  # cut in flight
        assert late_a.sent > 0  # the miss
        assert all(r.sent == 0 and r.error == STOPPED and not r.token_times for r in results[2:])
        rep = report(results, {"a": (0.0, 1.0), "b": (60.0, 1.0)}, span_s=30.0)
        assert rep["overall"]["attainment"] == 0.0 and rep["overall"]["errors"] >= 3
        # the cancelled stream was aborted
        asyncio.run(wait_quiet(srv.url, None, 0.0, timeout_s=60))
        srv.engine.check_integrity()
        again = asyncio.run(replay(srv.url, [Row(0.0, "b", 6, 3)]))
        assert again[0].ok and again[0].tokens == 3
    finally:
        srv.close()
    srv.engine.check_integrity()


def test_a_miss_is_called_only_when_certain():
    from prism_server.bench.replay import Result

    def res(out_len, sent, times, done=False, error=None):
        return Result(Row(0.0, "a", 5, out_len), sent, list(times), len(times), 200, error, done)

    slo = (1.0, 0.1)  # TTFT 1 s, TPOT 0.1 s
    assert not res(10, 0.0, []).missed(*slo, now=50.0)  # not sent yet
    assert not res(10, 1.0, []).missed(*slo, now=1.9)  # may still start in time
    assert res(10, 1.0, []).missed(*slo, now=2.1)  # no first token by its SLO
    assert res(10, 1.0, [2.5]).missed(*slo, now=2.6)  # a late first token
    # 10 tokens, first at 1.5: the mean gap misses once 9 gaps cannot fit in the time left
    assert not res(10, 1.0, [1.5, 1.6]).missed(*slo, now=2.3)
    assert res(10, 1.0, [1.5, 1.6]).missed(*slo, now=2.5)
    done = [1.5 + 0.05 * i for i in range(10)]
    assert not res(10, 1.0, done, done=True).missed(*slo, now=9.0)
    assert res(10, 1.0, [1.5 + 0.2 * i for i in range(10)], done=True).missed(*slo, now=9.0)
    assert res(10, 1.0, [], done=True, error="HTTP 503").missed(*slo, now=1.1)
    assert not res(1, 1.0, [1.5]).missed(*slo, now=100.0)  # one token: no TPOT to miss
