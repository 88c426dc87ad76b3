"""`python -m prism_server status` against a running server on the embedded models: the table
names every model with numbers that match /metrics; `--json` is the status document, valid
against its schema; a server that is not there is a clear error."""

from __future__ import annotations

import argparse
import json

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from prism_server.cli import status as status_cli
from prism_server.cli.main import main

MODELS = ("smollm2-135m", "gemma3-270m")
SLO = {"type": "object", "required": ["met", "missed"]}
MODEL = {
    "type": "object",
    "required": [
        "name",
        "residency",
        "weight_pages",
        "kv_pages_in_use",
        "kv_pages_cached_free",
        "prefix_idle_bytes",
        "num_running",
        "num_waiting",
        "activations",
        "evictions",
        "slo",
        "slo_last_minute",
        "transitions",
    ],
    "properties": {
        "name": {"type": "string"},
        "residency": {"enum": ["resident", "activating", "draining", "offloaded", "failed"]},
        "weight_pages": {"type": "integer", "minimum": 0},
        "kv_pages_in_use": {"type": "integer", "minimum": 0},
        "activations": {"type": "integer", "minimum": 0},
        "slo_last_minute": {"type": "object", "additionalProperties": SLO},
        "transitions": {"type": "array", "items": {"type": "array", "minItems": 2}},
    },
}
EVENT = {
    "type": "object",
    "required": ["time", "kind", "device"],
    "properties": {"kind": {"enum": ["residency", "move"]}, "time": {"type": "number"}},
}
SCHEMA = {
    "type": "object",
    "required": ["object", "time", "policy", "devices", "failed", "plan", "events"],
    "properties": {
        "object": {"const": "status"},
        "policy": {"enum": ["prism", "static", "swap"]},
        "devices": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["device", "pool", "models", "moves", "engine"],
                "properties": {
                    "pool": {
                        "type": "object",
                        "required": ["page_bytes", "capacity_pages", "free_pages", "owned_pages"],
                    },
                    "models": {"type": "array", "items": MODEL},
                },
            },
        },
        "events": {"type": "array", "items": EVENT},
        "failed": {"type": "array"},
    },
}


@pytest.fixture(scope="module")
def busy(server):
    for m in MODELS:
        body = {"model": m, "prompt": "The sky is", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    return server


def test_json_is_the_status_document_valid_against_its_schema(busy, capsys):
    assert main(["status", "--url", busy.url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, SCHEMA)
    names = [m["name"] for d in doc["devices"] for m in d["models"]]
    assert sorted(names) == sorted(MODELS)
    assert doc["events"] and all(
        a["time"] >= b["time"] for a, b in zip(doc["events"], doc["events"][1:])
    )


def test_the_table_shows_every_model_with_the_numbers_of_the_metrics(busy):
    console = Console(record=True, width=260, color_system=None)
    args = argparse.Namespace(url=busy.url, api_key=None, watch=False, interval=1.0, json=False)
    assert status_cli.run(args, console) == 0
    text = console.export_text()
    metrics = {}
    for fam in text_string_to_metric_families(httpx.get(busy.url + "/metrics").text):
        for s in fam.samples:
            metrics[(s.name, tuple(sorted(s.labels.items())))] = s.value
    for name in MODELS:
        (row,) = [line for line in text.splitlines() if line.strip("│ ").startswith(name)]
        cells = [c.strip() for c in row.split("│") if c.strip()]
        weights = metrics[("prism:model_memory_bytes", (("kind", "weights"), ("model_name", name)))]
        acts = metrics[("prism:model_activations_total", (("model_name", name),))]
        assert cells[0] == name and cells[1] == "resident", cells
        assert cells[2] == status_cli.size(weights), (cells, weights)
        assert cells[11] == str(int(acts)), cells
    assert "policy prism" in text and "recent events" in text


def test_a_server_that_is_not_there_is_a_clear_error(capsys):
    assert main(["status", "--url", "http://127.0.0.1:9", "--json"]) == 2
    assert "cannot read http://127.0.0.1:9/v1/status" in capsys.readouterr().err


def test_sizes_and_attainment_read_well():
    assert status_cli.size(3 << 29) == "1.50 GiB" and status_cli.size(5 << 20) == "5.0 MiB"
    assert status_cli.attainment({"met": 9, "missed": 1}) == "9/10 (90%)"
    assert status_cli.attainment({"met": 0, "missed": 0}) == "-"


def test_the_last_minute_counts_what_finished_in_it_and_forgets_the_rest():
    import time

    from prism_server.config import EngineConfig, ModelSpec
    from prism_server.engine.engine import Engine
    from scheduler.sampling_params import SamplingParams

    spec = ModelSpec("t", "dummy:tiny-llama", ttft_slo_ms=60_000, tpot_slo_ms=60_000)
    with Engine(EngineConfig(models=(spec,), device="cpu")) as e:
        e.generate("t", [[5, 6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
        snap = e.model_snapshot("t")
        assert dict((k, (m, x)) for k, m, x in snap.slo_recent) == {"ttft": (3, 0), "tpot": (3, 0)}
        assert snap.slo_recent == snap.slo_met
        worker = e.worker.models["t"]
        later = e.worker.call(lambda: worker._recent_slo(time.monotonic() + 1))  # all too old
        assert later == (("ttft", 0, 0), ("tpot", 0, 0)) and not worker.slo_log
