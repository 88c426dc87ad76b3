"""A screenshot of the dashboard under load, for the README: four tiny models on the CPU, a
bursty request mix that moves between them, one model evicted and activated again half way;
headless Chromium (the system's) through Playwright.

    python3 scripts/dashboard_screenshot.py [--seconds 60] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine import Engine  # noqa: E402
from prism_server.server.app import serve_in_thread  # noqa: E402

MODELS = ("chat", "code", "summarize", "translate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    specs = tuple(
        ModelSpec(m, "dummy:tiny-llama", seed=i, ttft_slo_ms=400, tpot_slo_ms=60)
        for i, m in enumerate(MODELS)
    )
    engine = Engine(EngineConfig(models=specs, device="cpu"))
    srv = serve_in_thread(engine)
    stop = threading.Event()
    start = time.monotonic()

    def load(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            phase = int((time.monotonic() - start) / 15) % 2  # the busy pair shifts every 15 s
            hot = MODELS[:2] if phase == 0 else MODELS[2:]
            model = rng.choice(hot) if rng.random() < 0.85 else rng.choice(MODELS)
            body = {"model": model, "prompt": "hello " * rng.randint(4, 60), "max_tokens": 24}
            httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            time.sleep(rng.expovariate(8))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        with sync_playwright() as p:
            chromium = shutil.which("chromium") or shutil.which("chromium-browser")
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(srv.url + "/dashboard")
            time.sleep(args.seconds / 2)
            httpx.post(srv.url + "/v1/models/translate/evict", json={}, timeout=60)
            time.sleep(args.seconds / 4)
            httpx.post(srv.url + "/v1/models/translate/activate", json={}, timeout=60)
            time.sleep(args.seconds / 4)
            page.screenshot(path=str(args.out), full_page=True)
            browser.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
        srv.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
