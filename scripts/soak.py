"""Soak: minutes of mixed traffic to several models sharing a page budget so small that requests
are preempted and pages move between models all the time, with clients vanishing at random.

At the end it checks that every accepted request either completed with the right output (the
greedy output of the same request run alone) or was cancelled by its client, that no page or block
leaked, that RSS stayed flat, and that nothing was logged at ERROR. It prints the figures.

    .venv/bin/python scripts/soak.py [--minutes 5] [--clients 12] [--embedded]
        [--evict-churn] [--lora-churn] [--devices N] [--fp8]

Chaos is a list of actions run every few seconds (`Soak.chaos`): admin evicts (`--evict-churn`);
LoRA adapters unloaded and loaded again through the admin API while requests for them run, with
more adapters than slots and some found in lora_dirs on first use (`--lora-churn`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.lora.synthetic import write_adapters  # noqa: E402
from prism_server.config import EngineConfig, ModelSpec  # noqa: E402
from prism_server.engine.engine import Engine  # noqa: E402
from prism_server.engine.memory_budget import weight_pool_bytes  # noqa: E402
from prism_server.serving.app import serve_in_thread  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [f"Item {i}: " + "lorem ipsum dolor " * (i % 5 + 1) for i in range(8)]
MAX_TOKENS = (8, 16, 24)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _ErrorCounter(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@dataclass
class Outcome:
    model: str
    prompt: int
    max_tokens: int
    stream: bool
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    disconnected: bool = False


@dataclass
class SoakConfig:
    seconds: float = 60.0
    clients: int = 12
    disconnect_prob: float = 0.2
    page_bytes: int = 64 << 10
    budget_pages: int = 7  # shared by every model: forces preemption and page movement
    embedded: bool = False  # add SmolLM2 to the tiny dummy models
    # eviction churn: the pool holds the weights of two of the three tiny models (LRU pressure),
    # and a random model is evicted through the admin API every `evict_every_s`
    evict_churn: bool = False
    evict_every_s: float = 1.0
    # LoRA churn: ADAPTERS of tiny-0 (two in the config, the rest found in lora_dirs), two
    # slots; one is unloaded or loaded again through the admin API every `evict_every_s`
    lora_churn: bool = False
    devices: int = 1  # emulated devices, each its pool (of the budget above) and engine thread
    fp8: bool = False  # the tiny models' weights in FP8 (quantized at load)
    seed: int = 0


ADAPTERS = ("ad-0", "ad-1", "ad-2", "ad-3")


@dataclass
class SoakReport:
    outcomes: list[Outcome] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    preemptions: int = 0
    pages_acquired: int = 0
    pages_released: int = 0
    pages_reclaimed: int = 0
    leaked_blocks: int = 0
    activations: int = 0
    evictions: int = 0
    admin_evicts: int = 0
    adapter_unloads: int = 0
    adapter_loads: int = 0
    integrity: str = "ok"

    @property
    def completed(self) -> int:
        return sum(o.status == 200 and not o.disconnected for o in self.outcomes)

    @property
    def cancelled(self) -> int:
        return sum(o.disconnected for o in self.outcomes)

    @property
    def rss_growth_mib(self) -> float:
        """Mean RSS of the last quarter minus that of the second quarter (after warm-up)."""
        q = max(len(self.rss_mib) // 4, 1)
        return statistics.mean(self.rss_mib[-q:]) - statistics.mean(self.rss_mib[q : 2 * q])

    @property
    def ok(self) -> bool:
        statuses = Counter(o.status for o in self.outcomes)
        return (
            not self.wrong
            and not self.errors
            and self.leaked_blocks == 0
            and self.integrity == "ok"
            and set(statuses) <= {200}
            and self.completed > 0
            and self.rss_growth_mib < 64
        )

    def summary(self) -> str:
        st = Counter(o.status for o in self.outcomes)
        return "\n".join(
            [
                f"requests: {len(self.outcomes)} sent, {self.completed} completed, "
                f"{self.cancelled} cancelled by their client, statuses {dict(st)}",
                f"wrong outputs: {len(self.wrong)}; errors logged: {len(self.errors)}",
                f"churn: {self.preemptions} preemptions, {self.pages_acquired} pages mapped, "
                f"{self.pages_released} unmapped, {self.pages_reclaimed} taken from another model",
                f"residency: {self.activations} activations, {self.evictions} evictions "
                f"({self.admin_evicts} through the admin API); adapters: "
                f"{self.adapter_unloads} unloads, {self.adapter_loads} loads",
                f"leaked blocks: {self.leaked_blocks}; integrity: {self.integrity}",
                f"RSS MiB: start {self.rss_mib[0]:.0f}, end {self.rss_mib[-1]:.0f}, "
                f"growth after warm-up {self.rss_growth_mib:+.1f}",
                "PASS" if self.ok else "FAIL",
            ]
        )


class Soak:
    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        specs = [
            ModelSpec(
                f"tiny-{i}",
                "dummy:tiny-llama",
                seed=i,
                block_size=4,
                max_cached_pages=2,
                max_num_batched_tokens=64,
                quantization="fp8" if cfg.fp8 else None,
            )
            for i in range(3)
        ]
        if cfg.embedded:
            specs.append(ModelSpec("smollm2-135m", "smollm2-135m", max_cached_pages=1))
        lora: dict = {}
        if cfg.lora_churn:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="soak-adapters-")
            root = Path(self._adapter_dir.name)
            write_adapters(root, "tiny-llama", ADAPTERS, rank=8, seed=cfg.seed)
            specs += [ModelSpec(n, base="tiny-0", adapter=str(root / n)) for n in ADAPTERS[:2]]
            lora = {"max_loras": 2, "lora_dirs": (str(root),)}
        page = cfg.page_bytes if not cfg.embedded else 4 << 20
        kv = (cfg.budget_pages + 1) * page
        budget = {"kv_budget_bytes": kv}
        if cfg.evict_churn:
            w = weight_pool_bytes(specs[0], torch.device("cpu"), page)
            budget = {"pool_budget_bytes": kv + 2 * w}
        self.engine = Engine(
            EngineConfig(
                models=tuple(specs),
                device="cpu",
                page_bytes=page,
                devices=cfg.devices,
                **budget,
                **lora,
            )  # fmt: skip
        )
        self.models = [s.name for s in specs if not s.is_adapter]
        self.models += list(ADAPTERS) if cfg.lora_churn else []
        self.chaos: list = [self._admin_evict] if cfg.evict_churn else []  # run every so often
        self.chaos += [self._adapter_churn] if cfg.lora_churn else []
        churn = cfg.evict_churn or cfg.lora_churn
        self.chaos_every_s = cfg.evict_every_s if churn else 3.0
        self.chaos_rng = random.Random(cfg.seed + 1)
        self.report = SoakReport()

    def _admin_evict(self) -> None:
        name = self.chaos_rng.choice(self.models)
        r = httpx.post(f"{self.url}/v1/models/{name}/evict", json={}, timeout=60)
        assert r.status_code in (200, 409), r.text
        self.report.admin_evicts += r.status_code == 200

    def _adapter_churn(self) -> None:
        """Unload a served adapter (its requests in flight finish first), or load one that is
        not (a request may have found it in lora_dirs meanwhile: then 400, already served)."""
        name = self.chaos_rng.choice(ADAPTERS)
        if name in self.engine.served:
            r = httpx.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name},
                           timeout=120)  # fmt: skip
            assert r.status_code in (200, 404), r.text
            self.report.adapter_unloads += r.status_code == 200
        else:
            path = str(Path(self._adapter_dir.name) / name)
            body = {"lora_name": name, "lora_path": path}
            r = httpx.post(f"{self.url}/v1/load_lora_adapter", json=body, timeout=120)
            assert r.status_code == 200 or "already served" in r.text, r.text
            self.report.adapter_loads += r.status_code == 200

    def _start_server(self) -> None:
        self.server = serve_in_thread(self.engine)
        self.url = self.server.url

    async def _client(self, session: aiohttp.ClientSession, deadline: float, rng) -> None:
        while time.monotonic() < deadline:
            o = Outcome(
                rng.choice(self.models),
                rng.randrange(len(PROMPTS)),
                rng.choice(MAX_TOKENS),
                rng.random() < 0.7,
            )
            drop_after = rng.randint(1, 6) if rng.random() < self.cfg.disconnect_prob else None
            body = {
                "model": o.model,
                "prompt": PROMPTS[o.prompt],
                "max_tokens": o.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": o.stream,
            }
            self.report.outcomes.append(o)
            try:
                async with session.post(f"{self.url}/v1/completions", json=body) as r:
                    o.status = r.status
                    if r.status != 200:  # (a status past 200 fails the soak: it says why)
                        o.text = (await r.text())[:300]
                        self.report.errors.append(f"{o.model}: HTTP {r.status}: {o.text}")
                        continue
                    if not o.stream:
                        if drop_after is not None:  # vanish before the answer
                            await asyncio.sleep(rng.random() * 0.2)
                            o.disconnected = True
                            r.close()
                            continue
                        data = await r.json()
                        o.text = data["choices"][0]["text"]
                        o.finish_reason = data["choices"][0]["finish_reason"]
                        continue
                    events = 0
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        events += 1
                        if drop_after is not None and events >= drop_after:
                            o.disconnected = True
                            r.close()
                            break
                        choice = json.loads(line[6:])["choices"][0]
                        o.text += choice["text"]
                        o.finish_reason = choice["finish_reason"] or o.finish_reason
            except aiohttp.ClientError as e:
                if not o.disconnected:
                    self.report.errors.append(f"client error: {e!r}")

    async def _traffic(self) -> None:
        deadline = time.monotonic() + self.cfg.seconds
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            clients = [
                self._client(session, deadline, random.Random(self.rng.random()))
                for _ in range(self.cfg.clients)
            ]
            await asyncio.gather(*clients, self._monitor(deadline))

    async def _monitor(self, deadline: float) -> None:
        last_chaos = time.monotonic()
        while time.monotonic() < deadline:
            self.report.rss_mib.append(rss_bytes() / 2**20)
            if self.chaos and time.monotonic() - last_chaos > self.chaos_every_s:
                for action in self.chaos:
                    await asyncio.to_thread(action)
                last_chaos = time.monotonic()
            await asyncio.sleep(0.5)
        self.report.rss_mib.append(rss_bytes() / 2**20)

    def _wait_idle(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while any(s.has_requests for s in self.engine.snapshots()):
            if time.monotonic() > end:
                break
            time.sleep(0.05)

    def _verify(self) -> None:
        r = self.report
        for name in ADAPTERS if self.cfg.lora_churn else ():  # every adapter back, for its refs
            if name not in self.engine.served:
                path = str(Path(self._adapter_dir.name) / name)
                self.engine.adapters.start_load(name, path, "tiny-0").result(timeout=120)
        refs: dict[tuple[str, int, int], str] = {}
        for o in r.outcomes:
            if o.status != 200 or o.disconnected:
                continue
            key = (o.model, o.prompt, o.max_tokens)
            if key not in refs:
                params = SamplingParams(max_tokens=o.max_tokens, temperature=0, ignore_eos=True)
                refs[key] = self.engine.generate(o.model, [PROMPTS[o.prompt]], params)[0].text
            if o.text != refs[key] or o.finish_reason != "length":
                r.wrong.append(f"{key}: got {o.text!r} ({o.finish_reason}), want {refs[key]!r}")
        pools = [w.pool for w in self.engine.workers]
        models = [m for w in self.engine.workers for m in w.snapshot_now().models]
        r.preemptions = sum(m.num_preemptions for m in models)
        r.pages_acquired = sum(p.acquired_total for p in pools)
        r.pages_released = sum(p.released_total for p in pools)
        r.pages_reclaimed = sum(p.reclaimed_total for p in pools)
        r.leaked_blocks = sum(m.kv_blocks_held for m in models)
        r.activations = sum(m.activations for m in models)
        r.evictions = sum(m.evictions for m in models)
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            r.integrity = f"FAILED: {e}"

    def run(self) -> SoakReport:
        errors = _ErrorCounter()
        logging.getLogger().addHandler(errors)
        try:
            self._start_server()
            asyncio.run(self._traffic())
            self._wait_idle()
            self._verify()
        finally:
            logging.getLogger().removeHandler(errors)
            self.report.errors += errors.records
            if getattr(self, "server", None) is not None:
                self.server.close()  # and the engine
            else:
                self.engine.close()
            if self.cfg.lora_churn:
                self._adapter_dir.cleanup()
        return self.report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--embedded", action="store_true", help="add SmolLM2 to the tiny models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=1, help="emulated devices the models share")
    ap.add_argument("--fp8", action="store_true", help="the tiny models' weights in FP8")
    ap.add_argument(
        "--evict-churn",
        action="store_true",
        help="a pool for two of the three tiny models, and random admin evicts every second",
    )
    ap.add_argument(
        "--lora-churn",
        action="store_true",
        help="four adapters of one model in two slots, one unloaded or loaded every second",
    )
    args = ap.parse_args()
    cfg = SoakConfig(
        seconds=args.minutes * 60,
        clients=args.clients,
        embedded=args.embedded,
        evict_churn=args.evict_churn,
        lora_churn=args.lora_churn,
        devices=args.devices,
        fp8=args.fp8,
        seed=args.seed,
    )
    t = time.monotonic()
    report = Soak(cfg).run()
    print(
        f"# soak: {args.minutes} min, {args.clients} clients, models "
        f"{3 + args.embedded}{' + 4 adapters' if args.lora_churn else ''}, budget "
        f"{cfg.budget_pages} pages, {args.devices} device(s), "
        f"wall {time.monotonic() - t:.0f} s"
    )
    print(report.summary())
    for w in report.wrong[:5] + report.errors[:5]:
        print("  ", w)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
