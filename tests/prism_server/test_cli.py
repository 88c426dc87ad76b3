"""The command line as a user runs it: the quick start, SIGTERM draining, config errors."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

ROOT = Path(__file__).resolve().parents[2]


def prism(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "prism_server", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def startup_lines(p: subprocess.Popen) -> list[str]:
    """What the server prints until it is ready: "Prism serves ... at URL" (after any failed
    model's line), then "Try: curl URL ... -d 'BODY'"."""
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("Try: curl"):
            break
    return lines


def url_of(lines: list[str]) -> str:
    return re.search(r"at (http://\S+)", "".join(lines)).group(1)


def stream_in_thread(url: str, req: dict, events: list[str], started: threading.Event):
    """Stream a completion from a thread: non-empty lines go to `events`; `started` is set at
    the first."""

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=req, timeout=120) as s:
            for ln in s.iter_lines():
                if ln:
                    events.append(ln)
                    started.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_generate_prints_the_answer_and_its_speed():
    p = prism(
        "generate",
        "--model",
        "smollm2-135m",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    )
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "Paris" in out
    assert re.search(r"decode [\d.]+ tokens/s", err)


def test_quick_start_serves_the_embedded_models_and_drains_on_sigterm():
    p = prism("--port", "0")
    try:
        lines = startup_lines(p)
        url = url_of(lines)
        assert "smollm2-135m, gemma3-270m" in lines[0]
        curl = lines[-1]
        path = re.search(r"curl http://[^/]+(\S+)", curl).group(1)
        body = json.loads(re.search(r"-d '(.*)'", curl).group(1))
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]

        events: list[str] = []
        started = threading.Event()
        req = {
            "model": "gemma3-270m",
            "prompt": "Once upon a time",
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": True,
        }
        t = stream_in_thread(url, req, events, started)
        assert started.wait(120)
        p.send_signal(signal.SIGTERM)  # in flight: must finish, not be cut off
        t.join(timeout=120)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_bad_config_names_the_field(tmp_path):
    cfg = tmp_path / "prism.toml"
    cfg.write_text(
        'port = 8000\n[[models]]\nname = "m"\nsource = "dummy:tiny-llama"\nmax_num_seqs = "many"\n'
    )
    p = prism("--config", str(cfg))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2
    assert "engine.models[0].max_num_seqs" in err and str(cfg) in err


def test_a_model_that_fails_to_load_does_not_stop_the_others(tmp_path):
    cfg = tmp_path / "prism.toml"
    cfg.write_text(
        "port = 0\n[[models]]\nname = 'bad'\nsource = 'dummy:no-such-preset'\n"
        "[[models]]\nname = 'good'\nsource = 'dummy:tiny-llama'\n"
    )
    p = prism("--config", str(cfg))
    try:
        lines = startup_lines(p)
        text = "".join(lines)
        assert "Model bad failed to load" in text and "no-such-preset" in text
        url = url_of(lines)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "good", "prompt": "x", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_the_step_trace_flag_writes_each_step_and_enforce_eager_is_taken(tmp_path):
    """serve --enforce-eager --step-trace PATH: both flags are taken (an eager engine on the
    CPU serves as any other: test_kernel_choice shows what the field turns off), and one JSON
    line per step is in PATH.<device> once the server has stopped."""
    cfg = tmp_path / "prism.toml"
    cfg.write_text("port = 0\n[[models]]\nname = 'm'\nsource = 'dummy:tiny-llama'\n")
    trace = tmp_path / "steps.jsonl"
    p = prism("serve", "--config", str(cfg), "--enforce-eager", "--step-trace", str(trace))
    try:
        url = url_of(startup_lines(p))
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
    steps = [json.loads(x) for x in (tmp_path / "steps.jsonl.cpu").read_text().splitlines()]
    assert sum(s["tokens"] for s in steps if s["model"] == "m") >= 3


def test_sigterm_aborts_what_is_still_running_at_the_shutdown_deadline(tmp_path):
    """shutdown_timeout_s = 2 with two long streams in flight: at the deadline both end with
    finish_reason abort and [DONE], and the process exits 0 within the deadline + 5 s."""
    cfg = tmp_path / "prism.toml"
    cfg.write_text(
        "port = 0\nshutdown_timeout_s = 2\n"
        "[[models]]\nname = 'smollm2-135m'\nsource = 'smollm2-135m'\n"
    )
    p = prism("--config", str(cfg))
    try:
        url = url_of(startup_lines(p))
        events: list[list[str]] = [[], []]
        started = [threading.Event(), threading.Event()]
        threads = [
            stream_in_thread(
                url,
                {
                    "model": "smollm2-135m",
                    "prompt": f"Tell a long story, number {i}.",
                    "max_tokens": 2000,
                    "ignore_eos": True,
                    "stream": True,
                },
                events[i],
                started[i],
            )
            for i in range(2)
        ]
        assert all(e.wait(120) for e in started)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert p.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert took < 2 + 5, took
        for ev in events:
            assert ev[-1] == "data: [DONE]"
            assert json.loads(ev[-2][6:])["choices"][0]["finish_reason"] == "abort"
            assert len(ev) < 2000  # cut at the deadline, not run to the end
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
    assert "Event loop is closed" not in err and "Traceback" not in err, err[-3000:]


def test_sigterm_while_a_request_waits_for_its_models_activation(tmp_path):
    """A pool for one of two tiny models: a long stream keeps `a` busy, so `b`'s stream waits
    for its activation; SIGTERM then drains both: `a` finishes, `b` is activated (evicting the
    now idle `a`), its stream completes, and the process exits 0."""
    page = 64 << 10
    cfg = tmp_path / "prism.toml"
    models = "".join(
        f"[[engine.models]]\nname = '{n}'\nsource = 'dummy:tiny-llama'\nblock_size = 4\n"
        f"seed = {i}\n"
        for i, n in enumerate("ab")
    )
    cfg.write_text(
        f"port = 0\n[engine]\ndevice = 'cpu'\npage_bytes = {page}\n"
        f"pool_budget_bytes = {17 * page}\n{models}"  # 9 weight pages each, 8 of KV: 896 tokens
    )
    p = prism("--config", str(cfg))
    try:
        url = url_of(startup_lines(p))
        models_now = {m["id"]: m["status"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert models_now == {"a": "resident", "b": "offloaded"}
        events: dict[str, list[str]] = {"a": [], "b": []}
        started = {n: threading.Event() for n in "ab"}
        body = {"prompt": [5, 6, 7], "ignore_eos": True, "stream": True, "temperature": 0}
        ta = stream_in_thread(
            url, {**body, "model": "a", "max_tokens": 880}, events["a"], started["a"]
        )
        assert started["a"].wait(120)
        tb = stream_in_thread(
            url, {**body, "model": "b", "max_tokens": 8}, events["b"], started["b"]
        )
        deadline = time.monotonic() + 30
        while (
            'prism:num_requests_waiting{model_name="b"} 1.0' not in httpx.get(url + "/metrics").text
        ):
            assert time.monotonic() < deadline, "b's request never queued"
            time.sleep(0.01)
        assert not events["b"] or events["b"] == [": loading"] * len(events["b"])
        p.send_signal(signal.SIGTERM)
        ta.join(timeout=120)
        tb.join(timeout=120)
        assert p.wait(timeout=60) == 0
        for n in "ab":
            ev = events[n]
            assert ev[-1] == "data: [DONE]", (n, ev[-3:])
            assert json.loads(ev[-2][6:])["choices"][0]["finish_reason"] == "length", n
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
    assert "Traceback" not in err, err[-3000:]


def test_an_slo_file_sets_the_models_slos_and_names_what_is_wrong(tmp_path):
    import json

    import pytest

    from prism_server.server_args import ConfigError, apply_slo_file, load_server_args

    args = load_server_args(None, ["a=dummy:tiny-llama", "b=dummy:tiny-llama"])
    f = tmp_path / "slos.json"
    f.write_text(json.dumps({"slos": {"a": {"ttft_s": 0.25, "tpot_s": 0.02}}}))
    got = {m.name: (m.ttft_slo_ms, m.tpot_slo_ms) for m in apply_slo_file(args, str(f)).models}
    assert got == {"a": (250.0, 20.0), "b": (None, None)}
    for bad, why in (
        ({"c": {"ttft_s": 1, "tpot_s": 1}}, "no such models"),
        ({"a": {"ttft_s": 1}}, "needs positive ttft_s and tpot_s"),
        ({"a": {"ttft_s": -1, "tpot_s": 1}}, "needs positive"),
    ):
        f.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=why):
            apply_slo_file(args, str(f))
