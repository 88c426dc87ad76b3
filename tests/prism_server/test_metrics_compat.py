# ruff: noqa: E501  (PromQL queries, kept whole)
"""Metrics that existing dashboards understand: every series vLLM's example Grafana dashboard
queries exists under Prism's prefix with data for a model that served requests; the process and
GC collectors are there, `_created` series are not, preemptions are counted; `promtool check
metrics` parses the exposition (where promtool is installed: CI installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
