"""The GPU check's last table (scripts/bench_engine.py report): each decode batch beside its floor,
the weights and the step's K/V over the copy rate (scripts/bench_engine.kv_bytes_a_step)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from scripts.bench_engine import DECODE_BATCHES, kv_bytes_a_step, main_report

LLAMA_8B = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)


def report(args: list[str], monkeypatch, capsys) -> dict[str, str]:
    """`bench_engine.py report ARGS`, run in this process: its table's rows by first cell."""
    monkeypatch.setattr(sys, "argv", ["bench_engine.py report", *args])
    main_report()
    out = capsys.readouterr().out
    return {ln.split("|")[0].strip(): ln for ln in out.splitlines() if "|" in ln}


def test_a_steps_kv_is_its_sequences_context_over_every_layer():
    # 16 sequences of 1024 + 64 / 2 positions, 32 layers of K and V, 8 heads of 128, bf16
    assert kv_bytes_a_step(LLAMA_8B, 16, 64) == 16 * 1056 * 32 * 2 * 8 * 128 * 2
    assert round(kv_bytes_a_step(LLAMA_8B, 16, 64) / 1e9, 2) == 2.21
    assert dict(DECODE_BATCHES)[16] == 64


def test_the_table_sets_each_batch_beside_its_floor(tmp_path, monkeypatch, capsys):
    wb = 16_000_000_000  # bytes of weights
    eng = {"ceilings": {"hbm_gbs": 3000.0}, "prism": {"weight_bytes": wb}}
    for b, tpot in ((1, 6.0), (16, 7.0), (64, 10.0)):
        kv = kv_bytes_a_step(LLAMA_8B, b, dict(DECODE_BATCHES)[b])
        eng["prism"][f"decode_b{b}"] = {"tpot_ms": tpot, "kv_bytes_a_step": kv}
    (tmp_path / "engine.json").write_text(json.dumps(eng))
    rows = report(["-", str(tmp_path / "engine.json"), "-"], monkeypatch, capsys)
    b16 = [c.strip() for c in rows["TPOT 8B bf16 B=16 ctx 1k"].split("|")]
    floor = (wb + kv_bytes_a_step(LLAMA_8B, 16, 64)) / 3000e9 * 1e3  # ms
    assert b16[2].startswith(f"floor {floor:.2f} ms")
    assert b16[3] == f"{7.0 / floor:.3f}" and b16[4] == "<= 5.5 ms (H200)"
    b1 = [c.strip() for c in rows["TPOT 8B bf16 B=1 ctx 1k"].split("|")]
    assert b1[4] == "<= 1.2 x floor"


def test_the_peer_stands_beside_the_batches_it_measured(tmp_path, monkeypatch, capsys):
    eng = {"ceilings": {"hbm_gbs": 3000.0}, "prism": {"weight_bytes": 16_000_000_000}}
    for b, tpot in ((1, 5.7), (16, 7.1), (64, 9.7)):
        eng["prism"][f"decode_b{b}"] = {"tpot_ms": tpot, "kv_bytes_a_step": 0}
    peer = {"decode_b1": {"tpot_ms": 6.3}, "decode_b16": {"tpot_ms": 13.35}}
    (tmp_path / "engine.json").write_text(json.dumps(eng))
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    args = ["-", str(tmp_path / "engine.json"), "-", str(tmp_path / "peer.json")]
    rows = report(args, monkeypatch, capsys)
    assert f"gpt-fast-style 6.30 ms ({5.7 / 6.3:.3f})" in rows["TPOT 8B bf16 B=1 ctx 1k"]
    assert f"gpt-fast-style 13.35 ms ({7.1 / 13.35:.3f})" in rows["TPOT 8B bf16 B=16 ctx 1k"]
    assert "gpt-fast" not in rows["TPOT 8B bf16 B=64 ctx 1k"]  # not measured there
