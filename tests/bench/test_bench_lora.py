"""scripts/bench_lora.py at a CPU smoke test's scale (the tiny preset, rank 4, a batch of 4): every
part measures and serves, and its table sets each figure beside its reference."""

from __future__ import annotations

import sys

from scripts.bench_lora import main, main_report


def test_the_lora_bench_runs_small_on_the_cpu_and_reports(tmp_path, monkeypatch, capsys):
    out = tmp_path / "lora.json"
    args = "--device cpu --preset tiny-llama --batch 4 --distinct 1,2,4 --register 6 --serve 3"
    args += f" --rank 4 --prompt 12 --tokens 6 --repeats 2 --json {out}"
    r = main(args.split())
    dec = r["decode"]
    assert dec["batch"] == 4 and dec["base"]["tpot_ms"] > 0
    for n in (1, 2, 4):
        assert dec[f"distinct_{n}"]["tpot_ms"] > 0 and dec[f"distinct_{n}"]["tokens"] == 4 * 6
    act = r["activation"]
    assert act["bytes"] > 0 and act["median_ms"] >= act["min_ms"] > 0 and act["h2d_ms"] > 0
    reg = r["registry"]
    assert reg["adapters"] == 6 and reg["adapter_bytes"] > 0
    assert reg["served"] == 3 and reg["served_tokens"] == 3 * 4
    monkeypatch.setattr(sys, "argv", ["bench_lora.py"])
    main_report([str(out)])
    rows = {ln.split("|")[0].strip(): ln for ln in capsys.readouterr().out.splitlines()}
    b4 = [c.strip() for c in rows["LoRA TPOT B=4, 4 distinct r4"].split("|")]
    assert b4[2] == f"base alone {dec['base']['tpot_ms']:.2f} ms"
    assert b4[3] == f"{dec['distinct_4']['tpot_ms'] / dec['base']['tpot_ms']:.3f}"
    act_row = next(v for k, v in rows.items() if k.startswith("LoRA activation"))
    assert f"H2D copy {act['h2d_ms']:.3f} ms" in act_row and "<= 2 ms" in act_row
    assert "6 adapters registered" in rows
