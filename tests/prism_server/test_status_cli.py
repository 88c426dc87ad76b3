"""`python -m prism_server status` against a running server on the embedded models: the table
names every model with numbers that match /metrics; `--json` is the status document, valid
against its schema; a server that is not there is a clear error. A base with LoRA adapters: a row
per adapter in the document (from a real engine: queues while a request runs and another waits
for the only slot, slots, residency after an eviction and an activation) and in the table, under
its base, in 80 to 120 columns."""

from __future__ import annotations

import argparse
import json
import queue
import re
import time

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from prism_server.cli import status as status_cli
from prism_server.cli.main import main
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.commands import Call
from prism_server.engine.engine import Engine
from prism_server.serving.status import status
from scheduler.sampling_params import SamplingParams
from tests.models.lora_cases import Spec, make_adapters
from tests.prism_server.lora_setup import tiny_base

MODELS = ("smollm2-135m", "gemma3-270m")
SLO = {"type": "object", "required": ["met", "missed"]}
COUNT = {"type": "integer", "minimum": 0}
ADAPTER = {
    "type": "object",
    "required": [
        "name",
        "base",
        "path",
        "rank",
        "slot",
        "residency",
        "num_running",
        "num_waiting",
        "requests_total",
        "activations",
        "evictions",
        "weight_bytes",
        "weight_pool_bytes",
        "last_used",
    ],
    "properties": {
        "name": {"type": "string"},
        "base": {"type": "string"},
        "path": {"type": "string"},
        "rank": {"type": "integer", "minimum": 1},
        "slot": {"type": ["integer", "null"], "minimum": 0},
        "residency": {"enum": ["resident", "activating", "offloaded"]},
        "num_running": COUNT,
        "num_waiting": COUNT,
        "requests_total": COUNT,
        "activations": COUNT,
        "evictions": COUNT,
        "weight_bytes": {"type": "integer", "minimum": 1},
        "weight_pool_bytes": COUNT,
        "last_used": {"type": "number"},
    },
    "additionalProperties": False,
}
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
        "adapters",
    ],
    "properties": {
        "name": {"type": "string"},
        "residency": {"enum": ["resident", "activating", "draining", "offloaded", "failed"]},
        "weight_pages": {"type": "integer", "minimum": 0},
        "kv_pages_in_use": {"type": "integer", "minimum": 0},
        "activations": {"type": "integer", "minimum": 0},
        "slo_last_minute": {"type": "object", "additionalProperties": SLO},
        "transitions": {"type": "array", "items": {"type": "array", "minItems": 2}},
        "adapters": {"type": "array", "items": ADAPTER},
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
        (row,) = [line for line in text.splitlines() if line.strip().startswith(name)]
        cells = re.split(r"\s{2,}", row.strip())
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


PAGE = 64 << 10


@pytest.fixture(scope="module")
def lora_docs(tmp_path_factory):
    """Status documents of a tiny base with adapters sql (rank 4) and kv (rank 2) and one adapter
    slot: `busy` while sql's long request runs and kv's waits for the slot; `idle` once both
    ended and sql was evicted; `back` after another sql request (activated, the slot taken back).
    With each, the base's snapshot at that time."""
    root = tmp_path_factory.mktemp("status-lora")
    base, hf = tiny_base(root)
    dirs = make_adapters(
        hf, {"sql": Spec(r=4), "kv": Spec(r=2, targets=("k_proj", "v_proj"))}, root / "lora"
    )
    specs = (ModelSpec("base", str(base), block_size=4),) + tuple(
        ModelSpec(n, base="base", adapter=str(d)) for n, d in dirs.items()
    )
    cfg = EngineConfig(
        models=specs, device="cpu", page_bytes=PAGE, kv_budget_bytes=64 * PAGE, max_loras=1
    )
    docs = {}
    with Engine(cfg) as e:
        done: queue.SimpleQueue = queue.SimpleQueue()

        def submit(model: str, tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            e.add_request(model, [8, 8, 1, 90], params, lambda o: o.finished and done.put(o))

        submit("sql", 40)
        submit("kv", 4)
        deadline = time.monotonic() + 60
        while "busy" not in docs and time.monotonic() < deadline:
            doc = status(e)
            rows = {a["name"]: a for a in doc["devices"][0]["models"][0]["adapters"]}
            if rows["sql"]["num_running"] and rows["kv"]["num_waiting"]:
                docs["busy"] = doc, e.model_snapshot("base")
            time.sleep(0.002)
        for _ in range(2):
            assert done.get(timeout=60).error is None
        worker = e.worker.models["base"]
        assert e.worker.execute(Call(lambda: worker.evict_adapter("sql"))) > 0
        time.sleep(0.05)  # (a step's snapshot published)
        docs["idle"] = status(e), e.worker.snapshot_now().model("base")
        submit("sql", 2)
        assert done.get(timeout=60).error is None
        # published now, after its request ended (the latest snapshot may still be one from
        # while its copy was in flight: `activating`)
        snap = e.worker.snapshot_now().model("base")
        docs["back"] = status(e), snap
        e.check_integrity()
    return docs


def adapter_rows(doc: dict) -> dict[str, dict]:
    (dev,) = doc["devices"]
    (base,) = dev["models"]
    return {a["name"]: a for a in base["adapters"]}


def test_each_adapter_is_a_row_of_its_bases_status(lora_docs):
    assert set(lora_docs) == {"busy", "idle", "back"}, "never saw sql running and kv waiting"
    for doc, snap in lora_docs.values():
        jsonschema.validate(doc, SCHEMA)
        rows = adapter_rows(doc)
        assert sorted(rows) == ["kv", "sql"]
        page = doc["devices"][0]["pool"]["page_bytes"]
        for a in snap.adapters:
            row = rows[a.name]
            assert row["base"] == "base" and row["path"] == a.path
            assert (row["rank"], row["weight_bytes"]) == (a.rank, a.weight_bytes)
            assert row["weight_pool_bytes"] == a.weight_pages * page
    busy, base = lora_docs["busy"][0], lora_docs["busy"][0]["devices"][0]["models"][0]
    sql, kv = adapter_rows(busy)["sql"], adapter_rows(busy)["kv"]
    assert (sql["num_running"], sql["num_waiting"], sql["slot"]) == (1, 0, 0)
    assert (kv["num_running"], kv["num_waiting"], kv["slot"]) == (0, 1, None)
    assert (base["num_running"], base["num_waiting"]) == (1, 1)  # its adapters' requests
    assert sql["requests_total"] == kv["requests_total"] == 1
    idle = adapter_rows(lora_docs["idle"][0])
    assert idle["sql"] | {"last_used": 0} == {
        **sql,
        "last_used": 0,
        "residency": "offloaded",
        "slot": None,
        "num_running": 0,
        "weight_pool_bytes": 0,
        "evictions": 1,
    }
    assert idle["kv"]["residency"] == "resident" and idle["kv"]["slot"] == 0
    assert idle["kv"]["weight_pool_bytes"] >= idle["kv"]["weight_bytes"]
    back = adapter_rows(lora_docs["back"][0])
    assert back["sql"]["residency"] == "resident" and back["sql"]["slot"] == 0
    assert (back["sql"]["activations"], back["sql"]["requests_total"]) == (1, 2)
    assert back["kv"]["slot"] is None and back["kv"]["activations"] == 0


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_table_has_each_adapter_under_its_base(lora_docs, width):
    doc = lora_docs["busy"][0]
    console = Console(record=True, width=width, color_system=None)
    console.print(status_cli.render(doc, width=width))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width
    assert "…" not in text  # a narrow terminal leaves columns out, never cuts a figure
    header = next(line for line in lines if line.lstrip().startswith("model"))
    for kept in ("state", "weights", "KV used", "run", "wait", "TTFT 1m", "TPOT 1m"):
        assert kept in header
    assert ("prefix" in header) == (width >= 120)
    starts = [i for i, line in enumerate(lines) if line.startswith((" base", " └─"))]
    firsts = [lines[i].split()[0] for i in starts]
    assert firsts[0] == "base" and all(f.startswith("└─") for f in firsts[1:]), firsts
    if width == 120:  # every figure on the adapter's first line, its rank and slot under
        rows = {f: re.split(r"\s{2,}", lines[i].strip()) for f, i in zip(firsts, starts)}
        assert rows["└─sql"] == ["└─sql", "resident", "64 KiB", *"---", "1", "0", "-", "-", "-"] + [
            "0",
            "0",
        ]
        assert rows["└─kv"][6:8] == ["0", "1"]
        under = lines[starts[firsts.index("└─sql")] + 1].split()
        assert under == ["r4", "slot", "0"]
