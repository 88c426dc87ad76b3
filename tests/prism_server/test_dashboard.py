"""The dashboard in headless Chromium (Debian's, driven with Playwright): the page loads with no
console errors, its charts carry the running models' names, a model's memory line falls when it
is evicted and rises when it is activated again, the models table has each LoRA adapter's row
under its base's, and a screenshot under load is kept as a test artifact
(tests/artifacts/dashboard.png)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.serving.app import serve_in_thread
from tests.models.lora_cases import Spec, make_adapters
from tests.prism_server.lora_setup import tiny_base

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MODELS = ("alpha", "beta")
KEY = "dash-key"


@pytest.fixture(scope="module")
def srv():
    specs = tuple(ModelSpec(m, "dummy:tiny-llama", seed=i) for i, m in enumerate(MODELS))
    engine = Engine(EngineConfig(models=specs, device="cpu"))
    s = serve_in_thread(engine, api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def page(srv):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.errors = []
        pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        pg.goto(f"{srv.url}/dashboard#key={KEY}")
        pg.wait_for_function("window.prismDashboard && window.prismDashboard.polls >= 2")
        yield pg
        browser.close()


def memory(page, model: str) -> float:
    """The latest bytes the page drew for the model (weights + KV)."""
    return page.evaluate(
        f"(() => {{ const s = window.prismDashboard.memory({model!r}); "
        "return s[s.length - 1][1]; })()"
    )


def wait_memory(page, model: str, pred, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = memory(page, model)
        if pred(v):
            return v
        time.sleep(0.2)
    raise AssertionError(f"{model}'s memory on the page stayed at {memory(page, model)}")


def admin(srv, action: str, model: str) -> None:
    r = httpx.post(
        f"{srv.url}/v1/models/{model}/{action}",
        json={},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_the_page_loads_without_errors_and_names_the_models(page):
    assert page.errors == []
    for section in ("#memory", "#rates", "#residency", "#slo"):
        names = page.eval_on_selector_all(
            f"{section} [data-model]", "els => [...new Set(els.map(e => e.dataset.model))]"
        )
        assert sorted(names) == sorted(MODELS), (section, names)
    assert page.locator("#memory svg polygon").count() >= 2 * len(MODELS)
    assert "policy prism" in page.inner_text("#summary")


def test_a_models_memory_line_moves_when_it_is_evicted_and_activated(srv, page):
    before = wait_memory(page, "beta", lambda v: v > 0)
    admin(srv, "evict", "beta")
    gone = wait_memory(page, "beta", lambda v: v < before)
    admin(srv, "activate", "beta")
    back = wait_memory(page, "beta", lambda v: v > gone)
    assert gone < before and back > gone
    page.wait_for_function(
        """(() => { const r = [...document.querySelectorAll('#residency rect[data-model="beta"]')];
        return r.length && r[r.length - 1].dataset.state === "resident"; })()"""
    )
    states = page.eval_on_selector_all(
        '#residency rect[data-model="beta"]', "els => els.map(e => e.dataset.state)"
    )
    assert "offloaded" in states  # the timeline shows where it was out
    moves = page.inner_text("#moves")
    assert "beta" in moves
    assert page.errors == []


def test_a_screenshot_under_load(srv, page):
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for m in MODELS:
                httpx.post(
                    f"{srv.url}/v1/completions",
                    json={"model": m, "prompt": "hello there", "max_tokens": 16},
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=60,
                )

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        page.wait_for_function(
            "Object.values(window.prismDashboard.rates || {}).some(r => r.some(([, v]) => v > 0))",
            timeout=30000,
        )
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / "dashboard.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert page.errors == []


def test_each_device_gets_its_own_memory_chart(page):
    """Two (emulated) devices: a memory chart each, with the models placed on it."""
    specs = tuple(ModelSpec(m, "dummy:tiny-llama", seed=i) for i, m in enumerate("abcd"))
    s = serve_in_thread(Engine(EngineConfig(models=specs, device="cpu", devices=2)))
    pg = page.context.browser.new_page()  # the module's browser (one Playwright per thread)
    try:
        errors = []
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        pg.goto(f"{s.url}/dashboard")
        pg.wait_for_function("window.prismDashboard && window.prismDashboard.polls >= 2")
        devices = pg.eval_on_selector_all("#memory svg", "els => els.map(e => e.dataset.device)")
        models = pg.eval_on_selector_all(
            "#memory svg polygon", "els => [...new Set(els.map(e => e.dataset.model))]"
        )
        assert devices == ["cpu:0", "cpu:1"] and sorted(models) == list("abcd")
        assert errors == []
    finally:
        pg.close()
        s.close()


def test_the_models_table_has_each_adapter_under_its_base(page, tmp_path):
    """A base with two adapters (one slot): their rows follow the base's, marked as its, with
    their rank, slot, residency and requests."""
    base, hf = tiny_base(tmp_path)
    specs = {"sql": Spec(r=4), "kv": Spec(r=2, targets=("k_proj", "v_proj"))}
    dirs = make_adapters(hf, specs, tmp_path / "lora")
    models = (ModelSpec("base", str(base), block_size=4),) + tuple(
        ModelSpec(n, base="base", adapter=str(d)) for n, d in dirs.items()
    )
    cfg = EngineConfig(models=models, device="cpu", max_loras=1, page_bytes=64 << 10)
    s = serve_in_thread(Engine(cfg))
    pg = page.context.browser.new_page()
    try:
        errors = []
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        for name in ("kv", "sql"):  # sql last: it holds the slot
            body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 2}
            assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        pg.goto(f"{s.url}/dashboard")
        pg.wait_for_function("window.prismDashboard && window.prismDashboard.polls >= 2")
        rows = pg.eval_on_selector_all(
            "#models tbody tr",
            """els => els.map(e => ({model: e.dataset.model, of: e.dataset.adapterOf || null,
                adapter: e.classList.contains("adapter"),
                cells: [...e.children].map(c => c.textContent)}))""",
        )
        assert [(r["model"], r["of"], r["adapter"]) for r in rows] == [
            ("base", None, False),
            ("sql", "base", True),
            ("kv", "base", True),
        ]
        sql, kv = rows[1]["cells"], rows[2]["cells"]
        assert sql[:3] == ["↳ sql", "LoRA of base · r4 · slot 0", "resident"]
        assert kv[:3] == ["↳ kv", "LoRA of base · r2 · no slot", "resident"]
        assert sql[5:8] == ["0", "0", "1"] and kv[7] == "1"  # running, waiting, requests
        assert rows[0]["cells"][7] == "2"  # the base's requests count its adapters'
        assert "2 adapter(s)" in pg.inner_text("#summary")
        assert errors == []
    finally:
        pg.close()
        s.close()
