"""Where each request's time goes. After every engine step the device charges each unfinished
request the time since its last charge, to one cause (scheduler.request.WAIT_CAUSES) read from
its state and what the step did; a request that ends is charged up to its end. The waits of a
request then add up to its time in the server, arrival to end. Engine thread only."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from scheduler.request import Request, RequestStatus
from scheduler.snapshot import Residency

if TYPE_CHECKING:
    from prism_server.engine.model_worker import ModelWorker

OFFLOADED = "offloaded"
ACTIVATION = "activation"
KV = "kv"
OTHER_MODELS = "other_models"
QUEUE = "queue"
PREFILL = "prefill"
DECODE = "decode"
DECODE_OTHER_MODELS = "decode_other_models"
PREEMPTED = "preempted"


def running_cause(req: Request, own_stepped: bool, others_stepped: bool) -> str:
    """A running request's cause: its prefill until its first token; then its own model's
    steps, or other models' steps when only they ran."""
    if req.first_token_time is None:
        return PREFILL
    return DECODE_OTHER_MODELS if others_stepped and not own_stepped else DECODE


def waiting_cause(
    resident: bool,
    blocked: bool,
    own_stepped: bool,
    others_stepped: bool,
    activating: bool = False,
) -> str:
    """The cause of a waiting request that was never preempted: its model not resident (its
    activation's copy in flight, else offloaded or draining: waiting for room or its turn);
    blocked on memory; behind its own model's requests (its model stepped without it); behind
    other models' steps; else its own queue."""
    if not resident:
        return ACTIVATION if activating else OFFLOADED
    if blocked:
        return KV
    if own_stepped or not others_stepped:
        return QUEUE
    return OTHER_MODELS


def cause(
    req: Request,
    resident: bool,
    blocked: bool,
    own_stepped: bool,
    others_stepped: bool,
    activating: bool = False,
) -> str:
    """One request's cause for the interval that ends now: its state, its model's (resident,
    blocked on memory, activating) and which models stepped (its own, others)."""
    if req.status is RequestStatus.RUNNING:
        return running_cause(req, own_stepped, others_stepped)
    if resident and req.num_preemptions:
        return PREEMPTED
    return waiting_cause(resident, blocked, own_stepped, others_stepped, activating)


def charge(req: Request, why: str, now: float) -> None:
    """Charge req up to `now` to `why`; a first token sampled since its last charge splits the
    interval: its prefill until that token."""
    first = req.first_token_time
    if first is not None and first > req.charged_until:
        req.charge(PREFILL, first)
    req.charge(why, now)


def closing_cause(req: Request) -> str:
    """The cause of the last interval of a request that ends now (its last token sampled in its
    own model's step, an abort, an error): by its state alone."""
    if req.status is RequestStatus.RUNNING:
        return PREFILL if req.first_token_time is None else DECODE
    return PREEMPTED if req.num_preemptions else QUEUE


def charge_device(
    models: Iterable[ModelWorker],
    stepped: Collection[str],
    blocked: Collection[str],
    now: float,
) -> None:
    """After an engine step: every unfinished request of every model up to `now`. stepped: the
    models whose step ran; blocked: the models whose new work waits for memory. O(requests with
    work), one float add each."""
    for m in models:
        s = m.scheduler
        if not (s.running or s.waiting):
            continue
        own = m.name in stepped
        others = len(stepped) > (1 if own else 0)
        if s.running:
            run = DECODE_OTHER_MODELS if others and not own else DECODE
            for r in s.running:
                if r.finish_reason is None:  # an ended one was charged as it ended
                    charge(r, PREFILL if r.first_token_time is None else run, now)
        if s.waiting:
            resident = m.residency is Residency.RESIDENT
            activating = m.residency is Residency.ACTIVATING
            wait = waiting_cause(resident, s.blocked or m.name in blocked, own, others, activating)
            loading = m.adapters.loading if m.adapters else ()  # adapters' copies in flight
            for r in s.waiting:
                if r.finish_reason is None:
                    if r.adapter is not None and r.adapter in loading:
                        charge(r, ACTIVATION, now)  # its adapter's activation
                    else:
                        charge(r, PREEMPTED if resident and r.num_preemptions else wait, now)
