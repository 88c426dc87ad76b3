"""`python -m prism_server status`: the balloon in a terminal, from a running server's
`GET /v1/status` (HTTP only, nothing of the engine imported).

Per device: every model's memory (weights, KV in use, KV kept free, idle prefix cache), its
residency, request rate (the planner's), queue, SLO attainment over the last minute, activations
and evictions, with a row under it per LoRA adapter (rank, slot, pages, residency, queue,
activations, evictions); the pool; the latest events. `--watch` redraws it every second;
`--json` prints the status document for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "resident": "green",
    "activating": "yellow",
    "draining": "yellow",
    "offloaded": "dim",
    "failed": "red",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: local)")
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.add_argument("--watch", action="store_true", help="redraw every second until Ctrl-C")
    p.add_argument(
        "--interval", type=_period, default=1.0, help="--watch period in seconds (above 0)"
    )
    p.add_argument("--json", action="store_true", help="print the status document as JSON")


def _period(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds above 0: {text!r}")
    return v


def fetch(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/status")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.load(r)
    if not isinstance(doc, dict) or doc.get("object") != "status" or "devices" not in doc:
        raise ValueError("the answer is not a Prism server's status")
    return doc


def size(n: float) -> str:
    """Bytes for people: 512.0 MiB, 1.50 GiB."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.0f} KiB"
    return f"{int(n)} B"


def attainment(slo: dict) -> str:
    """ "met/total (pct)" of one SLO over the window, "-" when nothing finished."""
    met, missed = slo.get("met", 0), slo.get("missed", 0)
    if not met + missed:
        return "-"
    return f"{met}/{met + missed} ({100 * met / (met + missed):.0f}%)"


def model_rows(dev: dict, rates: dict) -> list[list[str]]:
    """One row per model of a device, each followed by a row per LoRA adapter of it: the
    table's cells, as text."""
    page = dev["pool"]["page_bytes"]
    rows = []
    for m in dev["models"]:
        recent = m.get("slo_last_minute", {})
        rows.append(
            [
                m["name"],
                m["residency"],
                size(m["weight_pages"] * page),
                size(m["kv_pages_in_use"] * page),
                size(m["kv_pages_cached_free"] * page),
                size(m.get("prefix_idle_bytes", 0)),
                str(m["num_running"]),
                str(m["num_waiting"]),
                rate(rates.get(m["name"])),
                attainment(recent.get("ttft", {})),
                attainment(recent.get("tpot", {})),
                str(m["activations"]),
                str(m["evictions"]),
            ]
        )
        rows += [adapter_row(a, rates) for a in m.get("adapters", ())]
    return rows


ADAPTER_MARK = "└─"  # an adapter's row, under its base's (no space: the name never folds off it)


def adapter_row(a: dict, rates: dict) -> list[str]:
    """An adapter's cells: its rank and slot under its state, its pool bytes as its weights; it
    has no KV or SLO figures of its own (its requests' are its base's)."""
    slot = "" if a["slot"] is None else f" slot {a['slot']}"
    return [
        f"{ADAPTER_MARK}{a['name']}",
        f"{a['residency']}\nr{a['rank']}{slot}",
        size(a["weight_pool_bytes"]),
        "-",
        "-",
        "-",
        str(a["num_running"]),
        str(a["num_waiting"]),
        rate(rates.get(a["name"])),
        "-",
        "-",
        str(a["activations"]),
        str(a["evictions"]),
    ]


def rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


COLUMNS = (  # short: all of them take about 115 terminal columns (fewer: NARROW)
    "model",
    "state",
    "weights",
    "KV used",
    "KV free",
    "prefix",
    "run",
    "wait",
    "req/s",
    "TTFT 1m",
    "TPOT 1m",
    "act",
    "evict",
)


# what a narrow terminal leaves out, first to last: the model, its state, memory, queues and
# SLOs stay
NARROW = (("prefix",), ("act", "evict"), ("req/s",), ("KV free",))


def device_table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    """A device's table of `columns` (of COLUMNS) over the rows' cells."""
    t = Table(
        title=title,
        title_justify="left",
        # no rules between the columns: 13 fit in 120 terminal columns
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    for c in columns:
        if c == "model":  # a long name folds, whole
            t.add_column(c, overflow="fold")
        else:
            t.add_column(c, justify="left" if c == "state" else "right")
    keep = [COLUMNS.index(c) for c in columns]
    for row in rows:
        style = STATE_STYLE.get(row[1].split("\n")[0], "")
        cells = [Text(row[i], style=style) if i == 1 else row[i] for i in keep]
        t.add_row(*cells)
    return t


def _natural_width(t: Table) -> int:
    """The columns `t` takes unfolded."""
    return Console(width=1 << 12).measure(t).maximum


def event_line(e: dict, now: float) -> str:
    ago = f"{max(now - e['time'], 0.0):6.1f} s ago"
    if e["kind"] == "residency":
        return f"{ago}  {e['model']} -> {e['state']}"
    taker = e["taker"] or "the pool"
    return f"{ago}  {e['pages']} pages {e['giver']} -> {taker} ({e['reason']})"


def render(doc: dict, events: int = 8, width: int | None = None):
    """width: the terminal's columns; a narrow one leaves out NARROW's columns, first to last,
    until the table fits, so that every figure shown stays whole (None: every column)."""
    rates = (doc.get("plan") or {}).get("rates", {})
    parts = []
    for dev in doc["devices"]:
        pool = dev["pool"]
        page = pool["page_bytes"]
        title = (
            f"{dev['device']}  policy {dev['policy']}  pool {size(pool['owned_pages'] * page)}"
            f" used, {size(pool['free_pages'] * page)} free of "
            f"{size(pool['capacity_pages'] * page)}"
        )
        rows = model_rows(dev, rates)
        shown = list(COLUMNS)
        t = device_table(title, shown, rows)
        for drop in NARROW:
            if width is None or _natural_width(t) <= width:
                break
            shown = [c for c in shown if c not in drop]
            t = device_table(title, shown, rows)
        parts.append(t)
    for f in doc.get("failed", []):
        parts.append(Text(f"{f['name']}: failed to load: {f['error']}", style="red"))
    recent = doc.get("events", [])[:events]
    if recent:
        parts.append(Text("recent events", style="bold"))
        parts += [Text(event_line(e, doc["time"])) for e in recent]
    return Group(*parts)


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    try:
        doc = fetch(args.url, args.api_key)
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"error: cannot read {args.url}/v1/status: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    if not args.watch:
        console.print(render(doc, width=console.width))
        return 0
    try:
        with Live(render(doc, width=console.width), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    live.update(render(fetch(args.url, args.api_key), width=console.width))
                except (urllib.error.URLError, OSError, ValueError) as e:
                    live.update(Text(f"cannot read {args.url}/v1/status: {e}", style="red"))
    except KeyboardInterrupt:
        return 0
