# ruff: noqa: E501  (PromQL queries, kept whole)
"""Metrics that existing dashboards understand: every series vLLM's example Grafana dashboard
queries exists under Prism's prefix with data for a model that served requests; the process and
GC collectors are there, `_created` series are not, preemptions are counted; `promtool check
metrics` parses the exposition (where promtool is installed: CI installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

SMOL = "smollm2-135m"
# the PromQL of vLLM's example dashboard (examples/observability/prometheus_grafana/grafana.json)
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$m"}[1m])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$m"}[1m]) / rate(vllm:e2e_request_latency_seconds_count{model_name="$m"}[1m])',
    'rate(vllm:prompt_tokens_total{model_name="$m"}[1m])',
    'rate(vllm:generation_tokens_total{model_name="$m"}[1m])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$m"}[1m])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$m"}[1m]) / rate(vllm:inter_token_latency_seconds_count{model_name="$m"}[1m])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$m"}[1m])))',
    'vllm:num_requests_running{model_name="$m"}',
    'vllm:num_requests_waiting{model_name="$m"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$m"}[1m])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$m"}[1m]) / rate(vllm:time_to_first_token_seconds_count{model_name="$m"}[1m])',
    'vllm:kv_cache_usage_perc{model_name="$m"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$m"}[1m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$m"}[1m]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$m"}[1m]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$m"}[1m])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$m"}[1m])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$m"}[1m])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$m"}[1m])',
    'rate(vllm:num_preemptions_total{model_name="$m"}[1m])',
    'rate(vllm:prefix_cache_hits_total{model_name="$m"}[1m]) / rate(vllm:prefix_cache_queries_total{model_name="$m"}[1m])',
]


def scrape(server) -> tuple[str, dict[str, list]]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return text, samples


@pytest.fixture(scope="module")
def served(server):
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5}
    for stream in (False, True):
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=120
        )
        assert r.status_code == 200
    return server


def test_every_series_the_vllm_dashboard_queries_has_data(served):
    _, samples = scrape(served)
    series = sorted({m for q in VLLM_DASHBOARD for m in re.findall(r"vllm:(\w+)", q)})
    missing = []
    for name in series:
        ours = samples.get(f"prism:{name}", [])
        if not any(s.labels.get("model_name") == SMOL for s in ours):
            missing.append(name)
    assert not missing, missing
    count = [
        s for s in samples["prism:request_prompt_tokens_count"] if s.labels["model_name"] == SMOL
    ]
    assert count and count[0].value >= 2
    gen = samples["prism:request_generation_tokens_sum"]
    assert any(s.labels["model_name"] == SMOL and s.value > 0 for s in gen)


def test_process_and_gc_collectors_are_there_and_created_series_are_not(served):
    text, samples = scrape(served)
    assert "process_resident_memory_bytes" in samples and "process_cpu_seconds_total" in samples
    assert "python_gc_collections_total" in samples and "python_info" in samples
    assert "_created" not in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_parses_the_metrics(served):
    text, _ = scrape(served)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    out = (r.stdout + r.stderr).splitlines()
    # 0: clean, 3: lint findings only, 1: the exposition does not parse
    assert r.returncode in (0, 3), out
    # the one finding allowed: the `:` in vLLM's (and so Prism's) names
    assert all(line.endswith("metric names should not contain ':'") for line in out), out
    bad = subprocess.run(
        ["promtool", "check", "metrics"], input='x{a="1"} y\n', text=True, capture_output=True
    )
    assert bad.returncode == 1  # the check itself can fail


def test_the_shipped_grafana_dashboard_queries_series_that_exist():
    """Against a server whose balloon moved: a model evicted and activated again."""
    import json
    from pathlib import Path

    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.engine import Engine
    from prism_server.serving.app import serve_in_thread

    doc = json.loads((Path(__file__).resolve().parents[2] / "docs/grafana/prism.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    assert len(doc["panels"]) >= 10 and all(p["targets"] for p in doc["panels"])
    specs = (ModelSpec("a", "dummy:tiny-llama"), ModelSpec("b", "dummy:tiny-llama", seed=1))
    s = serve_in_thread(Engine(EngineConfig(models=specs, device="cpu")))
    try:
        body = {"model": "a", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        for action in ("evict", "activate"):
            r = httpx.post(f"{s.url}/v1/models/b/{action}", json={}, timeout=60)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        _, samples = scrape(s)
        while "prism:device_kvpr" not in samples and time.monotonic() < deadline:
            time.sleep(0.2)  # the planner's first plan
            _, samples = scrape(s)
    finally:
        s.close()
    series = sorted({m for e in exprs for m in re.findall(r"\b(prism:\w+)", e)})
    missing = [s for s in series if s not in samples]
    assert not missing, missing


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_a_real_prometheus_answers_every_query_of_the_vllm_dashboard(served, tmp_path):
    """Prometheus scrapes the server every second while it serves; each of the dashboard's
    queries, with the prefix swapped, then returns data."""
    import threading
    from urllib.parse import urlparse

    target = urlparse(served.url).netloc
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: prism\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = _free_port()
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stop = threading.Event()

    def traffic():
        body = {"model": SMOL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        while not stop.is_set():
            httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)

    t = threading.Thread(target=traffic)
    t.start()
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a few scrapes are in
            try:
                r = httpx.get(api, params={"query": "count_over_time(up[1m])"}, timeout=5)
                got = r.json()["data"]["result"]
                if got and float(got[0]["value"][1]) >= 6:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("prometheus did not scrape the server")
        empty = []
        for q in VLLM_DASHBOARD:
            query = q.replace("vllm:", "prism:").replace("$m", SMOL).replace("[1m]", "[30s]")
            r = httpx.get(api, params={"query": query}, timeout=10).json()
            assert r["status"] == "success", (query, r)
            if not r["data"]["result"]:
                empty.append(query)
        assert not empty, empty
    finally:
        stop.set()
        t.join()
        prom.terminate()
        prom.wait(timeout=30)
