"""`python -m prism_server bench simulate DIR`: a sweep's runs replayed in the device simulator
(scheduler/simulator.py) with the step costs each run measured on the device (every model's
fitted latency model, sampled from /v1/status) and the sweep's SLOs, beside what the run
measured; or, with --scales, what other scales would do. A change to the arbitrator can then be
tried against a device's real run on any machine, and a sweep's scales chosen before the device
time is spent.

What the simulator knows: the batch schedulers, the arbitrator and the requests' deadlines, as
the engine runs them, and each step's cost from its shape; a fixed host time between steps (the
run's mean). What it does not: a step's noise, one model's steps slowing another's, activations
and evictions. `prism` replays exactly the prism policy's decisions (KV unbounded: the balloon
lends what a model needs); `static` runs the same arbitrator over each model's fixed KV quota,
an approximation of static partitioning (which steps models round-robin, FCFS).

With --step-trace, the device's step costs are fitted to a step trace of a run (serve --step-trace:
every step the device ran, its shape and its measured seconds) instead of taken from the online
fits the run recorded: all of a model's steps over the run, not the last window of them. With
--noise-seeds N too, each step of the simulation lasts its fit times a ratio drawn from that trace
(a model's measured / fitted seconds of its steps of the same kind, prefill or decode), and every
prediction is the mean over N seeds, with its worst: the device's scatter that no estimate knows.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from prism_server.bench.workload import Row, scale_rate
from scheduler.batch_scheduler import SchedulerConfig
from scheduler.latency_model import LatencyModel, StepShape
from scheduler.policy import POLICIES
from scheduler.simulator import SimArrival, SimModel, StepNoise, simulate

SIMULATED = ("prism", "static")


def sim_models(
    latency: dict[str, dict],
    slos: dict[str, dict],
    policy: str = "prism",
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
) -> list[SimModel]:
    """The simulator's models from a run's `latency` record (model -> coefficients and KV block
    capacity) and the SLOs."""
    if policy not in SIMULATED:
        raise ValueError(f"the simulator replays {', '.join(SIMULATED)}, not {policy!r}")
    missing = sorted(set(slos) - set(latency))
    if missing:
        raise ValueError(f"no measured step costs for {missing}")
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1 << 20,  # the workload's requests all fitted the servers
        reserve_output_tokens=POLICIES[policy].reserve_output_tokens,
    )
    return [
        SimModel(
            name,
            LatencyModel(latency[name]["coefficients"]),
            slos[name]["ttft_s"],
            slos[name]["tpot_s"],
            cfg,
            kv_blocks=latency[name]["kv_blocks_capacity"] if policy == "static" else None,
        )
        for name in sorted(slos)
    ]


def read_step_trace(path: str | Path) -> dict[str, list[tuple[StepShape, float]]]:
    """Each model's steps in a step trace (JSON lines, gzipped or not): (shape, seconds)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    samples: dict[str, list[tuple[StepShape, float]]] = defaultdict(list)
    with opener(path, "rt") as f:
        for line in f:
            x = json.loads(line)
            if "tokens" in x and x.get("run_s", 0) > 0:
                attn = x.get("attn")
                if attn is None:  # a trace from before attn was recorded
                    attn = _attn_of(x["tokens"], x["seqs"], x["kv"])
                shape = StepShape(x["tokens"], x["seqs"], float(attn), x["kv"])
                samples[x["model"]].append((shape, x["run_s"]))
    return dict(samples)


def fit_step_trace(path: str | Path) -> dict[str, list[float]]:
    """Each model's latency coefficients fitted to every step of a step trace."""
    out = {}
    for model, steps in read_step_trace(path).items():
        lm = LatencyModel()
        lm.fit_profile(steps)
        out[model] = list(lm.coefficients)
    return out


def _kind(shape: StepShape) -> str:
    return "prefill" if shape.has_prefill else "decode"


def step_ratios(path: str | Path, costs: dict[str, list[float]]) -> dict[str, dict[str, list]]:
    """Each model's steps in a trace as measured / fitted seconds (`costs`: the fits), by
    kind (prefill: a step with a prompt chunk; decode); "*": every model's, pooled."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for model, steps in read_step_trace(path).items():
        lm = LatencyModel(tuple(costs[model]))
        for shape, seconds in steps:
            est = lm.estimate(shape)
            if est > 0:
                out[model][_kind(shape)].append(seconds / est)
                out["*"][_kind(shape)].append(seconds / est)
    return {m: dict(k) for m, k in out.items()}


def noise_from(ratios: dict[str, dict[str, list[float]]], seed: int) -> StepNoise:
    """Draws a step's ratio from its model's measured ratios of its kind (every model's where
    it has none), with its own seeded generator."""
    rng = random.Random(seed)

    def draw(model: str, shape: StepShape) -> float:
        kind = _kind(shape)
        pool = ratios.get(model, {}).get(kind) or ratios.get("*", {}).get(kind)
        return rng.choice(pool) if pool else 1.0

    return draw


def _attn_of(tokens: int, seqs: int, kv: int) -> float:
    """A step's attention pairs from its tokens, sequences and KV tokens: exact for one sequence
    or decodes only; with a prefill chunk among decodes, each sequence's cache taken as equal."""
    if tokens == seqs:
        return float(kv)
    new = tokens - seqs + 1  # one prefill chunk, the rest decodes
    cached = (kv - tokens) / seqs
    return new * (cached + (new + 1) / 2) + (seqs - 1) * (cached + 1)


def with_step_costs(sweep: dict, costs: dict[str, list[float]], policy: str = "prism") -> dict:
    """The sweep with every recorded run of `policy` given these step costs."""
    sweep = copy.deepcopy(sweep)
    for run in sweep["policies"].get(policy, {}).get("runs", []):
        for model, rec in (run.get("latency") or {}).items():
            if model in costs:
                rec["coefficients"] = costs[model]
    return sweep


def predict(
    rows: Sequence[Row],
    models: list[SimModel],
    scale: float,
    overhead_s: float = 0.0,
    ratios: dict | None = None,
    seeds: int = 0,
) -> dict:
    """The workload at `scale` in the simulator: attainment (joint, TTFT, TPOT) and the share
    of time the device is busy. With `ratios` and seeds > 0: each figure the mean over that many
    noisy simulations (noise_from), and `attainment_min` the worst joint attainment."""
    if ratios and seeds > 0:
        runs = [
            _predict(rows, models, scale, overhead_s, noise_from(ratios, s)) for s in range(seeds)
        ]
        out = {k: sum(r[k] for r in runs) / seeds for k in runs[0] if k != "scale"}
        return {"scale": scale, **out, "attainment_min": min(r["attainment"] for r in runs)}
    return _predict(rows, models, scale, overhead_s)


def _predict(
    rows: Sequence[Row],
    models: list[SimModel],
    scale: float,
    overhead_s: float,
    noise: StepNoise | None = None,
) -> dict:
    scaled = scale_rate(rows, scale)
    arrivals = [SimArrival(r.arrival_s, r.model, r.prompt_len, r.output_len) for r in scaled]
    sim = simulate(models, arrivals, overhead_s, noise)
    n = max(len(sim.results), 1)
    end = max((s.start + s.seconds for s in sim.steps), default=0.0)
    return {
        "scale": scale,
        "attainment": sim.attainment(),
        "ttft_attainment": sum(r.met_ttft for r in sim.results) / n,
        "tpot_attainment": sum(r.met_tpot for r in sim.results) / n,
        "busy": sum(s.seconds for s in sim.steps) / end if end else 0.0,
    }


def _overhead(run: dict) -> float:
    per = [e.get("host_per_step_s") or 0.0 for e in (run.get("engine") or {}).values()]
    return max(per, default=0.0)


def simulate_sweep(
    sweep: dict,
    rows: Sequence[Row],
    policy: str = "prism",
    scales: Sequence[float] = (),
    max_num_batched_tokens: int = 2048,
    ratios: dict | None = None,
    seeds: int = 0,
) -> list[dict]:
    """Per run of `policy` with measured step costs: its prediction beside its measurement;
    then each of `scales` not run yet predicted with the step costs of the policy's latest such
    run."""
    slos = sweep["config"]["slos"]
    runs = [r for r in sweep["policies"].get(policy, {}).get("runs", []) if r.get("latency")]
    if not runs:
        raise ValueError(
            f"no {policy} run of this sweep recorded its step costs (runs from before the "
            "bench sampled them cannot be replayed)"
        )
    out = []
    for run in runs:
        models = sim_models(run["latency"], slos, policy, max_num_batched_tokens)
        p = predict(rows, models, run["scale"], _overhead(run), ratios, seeds)
        o = run["report"]["overall"]
        busy = [e["busy"] for e in (run.get("engine") or {}).values()]
        p["measured"] = {
            "attainment": o["attainment"],
            "ttft_attainment": o["ttft_attainment"],
            "tpot_attainment": o["tpot_attainment"],
            "busy": max(busy) if busy else None,
        }
        out.append(p)
    latest = max(runs, key=lambda r: r["scale"])
    models = sim_models(latest["latency"], slos, policy, max_num_batched_tokens)
    measured = {r["scale"] for r in runs}  # predicted beside their measurement above already
    out += [
        predict(rows, models, s, _overhead(latest), ratios, seeds)
        for s in scales
        if s not in measured
    ]
    return out


def markdown(policy: str, predictions: list[dict]) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    def cell(d: dict) -> str:
        worst = f", worst {pct(d['attainment_min'])}" if "attainment_min" in d else ""
        return (
            f"{pct(d['attainment'])} ({pct(d['ttft_attainment'])} / "
            f"{pct(d['tpot_attainment'])}{worst}), {pct(d['busy'])}"
        )

    lines = [
        f"| {policy} scale | simulated: joint (TTFT / TPOT), busy | measured: joint (TTFT / TPOT), "
        "busy |",
        "|---|---|---|",
    ]
    for p in predictions:
        measured = cell(p["measured"]) if "measured" in p else "not run"
        lines.append(f"| x{p['scale']:g} | {cell(p)} | {measured} |")
    return "\n".join(lines)
