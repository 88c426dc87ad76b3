"""`GET /v1/status`: the balloon as JSON, for the status command, the dashboard and the bench.

Built from the devices' published snapshots and the control loop's last plan only (never the
engine thread's live objects). Times are the server's monotonic clock; `time` is its value now,
so a client maps them onto its own clock with one offset.

A model's `adapters` are its LoRA adapters, a row each (served by its steps: the base's
`num_running` and `num_waiting` count their requests too). An adapter's `residency` is
`resident` (its weight pages mapped, `weight_pool_bytes` of them), `activating` (its copy
in flight) or `offloaded` (in its host copy only), as /v1/models says; `slot` is its base's
adapter slot, null while it has none; `weight_bytes` its size.

    {"object": "status", "time": 1234.5, "policy": "prism",
     "devices": [{"device": "cuda:0", "seq": 812, "time": ..., "policy": "prism",
                  "pool": {"page_bytes", "capacity_pages", "created_pages", "free_pages",
                           "owned_pages", "capacity_bytes"},
                  "models": [{"name", "residency", "weight_bytes", "kv_bytes", "kv_used_bytes",
                              "num_running", "num_waiting", "activations", "evictions",
                              "transitions": [[time, state], ...], "slo": {...}, ...,
                              "adapters": [{"name", "base", "path", "rank", "slot",
                                            "residency", "num_running", "num_waiting",
                                            "requests_total", "activations", "evictions",
                                            "weight_bytes", "weight_pool_bytes",
                                            "last_used"}, ...]}],
                  "moves": [{"seq", "time", "giver", "taker", "pages", "reason"}, ...],
                  "moved": [{"giver", "taker", "reason", "pages"}, ...],
                  "engine": {"steps", "step_seconds", "host_seconds", "step_overhead_s"}}],
     "failed": [{"name", "error"}],
     "plan": {"time", "rates", "demand", "kvpr", "assignment", "offloaded"} | null,
     "events": [{"time", "kind": "residency", "device", "model", "state"} |
                {"time", "kind": "move", "device", "giver", "taker", "pages", "reason"}, ...]}
"""

from __future__ import annotations

import dataclasses
import time

from scheduler.snapshot import AdapterSnapshot, DeviceSnapshot, ModelSnapshot


def _adapter(a: AdapterSnapshot, page_bytes: int) -> dict:
    return {
        "name": a.name,
        "base": a.base,
        "path": a.path,
        "rank": a.rank,
        "slot": a.slot,
        "residency": a.residency,
        "num_running": a.num_running,
        "num_waiting": a.num_waiting,
        "requests_total": a.requests_total,
        "activations": a.activations,
        "evictions": a.evictions,
        "weight_bytes": a.weight_bytes,
        "weight_pool_bytes": a.weight_pages * page_bytes,
        "last_used": a.last_used,
    }


def _model(m: ModelSnapshot, page_bytes: int) -> dict:
    d = dataclasses.asdict(m)
    d["adapters"] = [_adapter(a, page_bytes) for a in m.adapters]
    d["residency"] = m.residency.value
    d["transitions"] = [[t, s.value] for t, s in m.transitions]
    d["slo"] = {k: {"met": met, "missed": missed} for k, met, missed in m.slo_met}
    d["slo_last_minute"] = {k: {"met": met, "missed": missed} for k, met, missed in m.slo_recent}
    del d["slo_met"], d["slo_recent"]
    d["kv_blocks_held"] = m.kv_blocks_held
    d["prefix_idle_bytes"] = m.kv_blocks_prefix_idle * m.kv_block_bytes
    d["kv_bytes"] = m.kv_pages * page_bytes
    d["kv_used_bytes"] = m.kv_pages_in_use * page_bytes
    d["weight_pool_bytes"] = m.weight_pages * page_bytes
    return d


def _device(s: DeviceSnapshot) -> dict:
    p = s.pool
    return {
        "device": s.device,
        "seq": s.seq,
        "time": s.time,
        "policy": s.policy,
        "pool": {
            "page_bytes": p.page_bytes,
            "capacity_pages": p.capacity,
            "created_pages": p.created,
            "free_pages": p.free,
            "owned_pages": p.owned,
            "capacity_bytes": p.capacity * p.page_bytes,
        },
        "models": [_model(m, p.page_bytes) for m in s.models],
        "moves": [dataclasses.asdict(mv) for mv in s.moves],
        "moved": [
            {"giver": g, "taker": t or None, "reason": r, "pages": n} for g, t, r, n in s.moved
        ],
        "engine": dataclasses.asdict(s.engine),
    }


def status(engine) -> dict:
    snaps = engine.snapshots()
    view = engine.plan_view()
    plan = None
    if view is not None:
        pl = view.placement
        plan = {
            "time": view.time,
            "rates": view.rates,
            "demand": view.demand,
            "kvpr": pl.kvpr,
            "assignment": {k: list(v) for k, v in pl.assignment.items()},
            "offloaded": list(pl.offloaded),
        }
    return {
        "object": "status",
        "time": time.monotonic(),
        "policy": snaps[0].policy if snaps else engine.config.policy,
        "devices": [_device(s) for s in snaps],
        "failed": [
            {"name": name, "error": sm.error} for name, sm in engine.served.items() if sm.failed
        ],
        "plan": plan,
        "events": events(snaps),
    }


MAX_EVENTS = 64


def events(snaps: list[DeviceSnapshot]) -> list[dict]:
    """The latest residency changes and page moves of every device, newest first."""
    out = []
    for s in snaps:
        for m in s.models:
            out += [
                {
                    "time": t,
                    "kind": "residency",
                    "device": s.device,
                    "model": m.name,
                    "state": st.value,
                }
                for t, st in m.transitions
            ]
        out += [
            {
                "time": mv.time,
                "kind": "move",
                "device": s.device,
                "giver": mv.giver,
                "taker": mv.taker,
                "pages": mv.pages,
                "reason": mv.reason,
            }
            for mv in s.moves
        ]
    out.sort(key=lambda e: e["time"], reverse=True)
    return out[:MAX_EVENTS]
