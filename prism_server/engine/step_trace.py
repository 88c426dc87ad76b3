"""The step trace: one JSON line per model step a device runs (its shape, the latency model's
estimate before it, the seconds it took, and the arbitration that picked it), which
`python -m prism_server bench simulate DIR --step-trace FILE` fits its step costs to. Written in
batches by the device's engine thread, to `<path>.<device>`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler.arbitrator import Pick
from scheduler.latency_model import StepShape

_BATCH = 1000  # lines kept before they are written


class StepTrace:
    def __init__(self, path: Path, device: str):
        self.path = path.with_name(f"{path.name}.{device.replace(':', '')}")
        self.path.write_text("")
        self._lines: list[str] = []

    def record(
        self,
        model: str,
        start: float,
        shape: StepShape,
        estimate: float,
        took: float,
        pick: tuple[Pick | None, float] | None = None,
    ) -> None:
        """One step done (a step launched ahead is done once its tokens are read, in a later
        engine step), from when the device could start it; pick: the arbitration of the engine
        step that read it and its seconds."""
        rec: dict[str, Any] = {"t": start, "s": took, "model": model, "run_s": took}
        rec |= {"tokens": shape.tokens, "seqs": shape.seqs, "kv": shape.kv, "attn": shape.attn}
        rec["est_s"] = estimate
        if pick is not None and pick[0] is not None and pick[0].model == model:
            chosen, arb_s = pick
            rec |= {"arb_s": arb_s, "budget": chosen.token_budget, "admit": len(chosen.admit)}
        self._lines.append(json.dumps(rec) + "\n")
        if len(self._lines) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            with self.path.open("a") as f:
                f.write("".join(self._lines))
            self._lines.clear()
