"""Request state: bookkeeping only (counters, status, derived properties); no scheduling logic.
Times are `time.monotonic()` seconds, always passed in (this package reads no clock)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams

# the longest gap between two tokens of a stream that a plan may make, in TPOT SLOs
MAX_GAP_SLOS = 4.0
# the share of the TPOT SLO a plan keeps in reserve: a client sees each token a little after the
# engine emits it (the stream's delivery, host jitter, the estimate's error), and a short
# output's mean TPOT has one or two gaps to absorb it
TPOT_MARGIN = 0.05
PENDING = -1  # a reserved token slot: sampled by a step on the device, not read yet

# where a request's time goes, in seconds (Request.waits): before its first token, waiting while
# its model is offloaded (for room or its turn to activate), for its activation's copy, for KV
# pages, behind other models' steps, behind its own model's requests, then its own prefill; after
# it, its model's steps, other models' steps, and waiting to be recomputed after a preemption
WAIT_CAUSES = (
    "offloaded",
    "activation",
    "kv",
    "other_models",
    "queue",
    "prefill",
    "decode",
    "decode_other_models",
    "preempted",
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, most likely first


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta), handed to the request's sink."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    first_scheduled_time: float | None = None  # when it first ran
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held (not computed)
    # with the first token, if asked for: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    # with the final output (finished): where its time went (WAIT_CAUSES -> seconds), when its
    # first token was sampled (None: never), its preemptions and the tokens they threw away
    waits: dict[str, float] | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    recomputed_tokens: int = 0


@dataclass(eq=False)
class Request:
    request_id: str  # internal, unique, made by the server (never a client's id)
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float  # when the server accepted it
    sink: Callable[[RequestOutput], None] | None = None
    # the LoRA adapter of its model it runs with (None: the model itself); its K/V differ from
    # the model's, so it neither takes nor leaves blocks in the prefix cache
    adapter: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # computed tokens its preemptions threw away
    first_scheduled_time: float | None = None  # when the batch scheduler first admitted it
    priority: int = 0  # lower goes first among equal deadlines (vLLM's convention)
    ttft_slo: float | None = None  # seconds; set when its model queues it
    tpot_slo: float | None = None
    first_token_time: float | None = None  # when its first output token was sampled
    last_token_time: float | None = None  # when its latest output token was sampled
    # params.prompt_logprobs: each prompt token's logprob after the first, as prefill computes them
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # seconds by cause (WAIT_CAUSES) from arrival to `charged_until`
    waits: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAIT_CAUSES, 0.0))
    charged_until: float = 0.0  # set to arrival_time

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids) + self.output_token_ids
        self.charged_until = self.arrival_time

    def charge(self, cause: str, now: float) -> None:
        """The time since the last charge (since arrival, at first) up to `now` went to `cause`
        (a WAIT_CAUSES key); a `now` before the last charge adds nothing."""
        dt = now - self.charged_until
        if dt > 0.0:
            self.waits[cause] += dt
            self.charged_until = now

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ttft_deadline(self) -> float:
        return self.arrival_time + (self.ttft_slo if self.ttft_slo is not None else float("inf"))

    @property
    def deadline(self) -> float:
        """When its next token is due: its TTFT deadline until the first token; then the time
        that keeps its mean TPOT (what the SLO bounds: (last - first) / (n - 1)) within the SLO,
        first token + tokens so far x TPOT SLO (less TPOT_MARGIN). Slack a fast stream banks
        lets another model's long step run, but a gap is never planned past MAX_GAP_SLOS x the
        SLO after its latest token (a stream that stalls for seconds is broken, whatever its
        mean)."""
        if self.last_token_time is None or self.first_token_time is None:
            return self.ttft_deadline
        if self.tpot_slo is None:
            return float("inf")
        tpot = self.tpot_slo * (1 - TPOT_MARGIN)
        banked = self.first_token_time + self.num_output_tokens * tpot
        return min(banked, self.last_token_time + MAX_GAP_SLOS * self.tpot_slo)

    def reserve_token(self) -> None:
        """A slot for the output token a step still running on the device samples, so that the
        next step can be scheduled before it is known (PENDING until `append_token` fills it)."""
        self.all_token_ids.append(PENDING)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if len(self.all_token_ids) == self.num_prompt_tokens + len(self.output_token_ids):
            self.all_token_ids[-1] = token_id  # its slot was reserved
        else:
            self.all_token_ids.append(token_id)
