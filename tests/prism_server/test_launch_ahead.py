"""Launch ahead: a model's next decode step is launched from the last step's tokens while they are
still on the device, then those tokens are read. The same tokens, text and endings as steps that
read their tokens first, for every way a request ends (length, EOS in the unread token, a stop
string, an abort, a failure), with new requests arriving, and the KV accounting exact: a request
ended while a step that has it is in flight keeps its blocks until that step is read."""

from __future__ import annotations

import pytest

from scheduler.request import PENDING, FinishReason, Request
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import tiny_cpu_worker

PROMPT = [5, 6, 7, 8, 9]


class Run:
    """Steps a worker as the device's engine thread does (the hook renders text while a step
    runs, never reading the step just launched) and records what each request received.
    make: a new ModelWorker (the tiny model on the CPU by default)."""

    def __init__(self, ahead: bool, make=tiny_cpu_worker):
        self.me = make()
        self.me.launch_ahead = ahead
        self.got: dict[str, list] = {}
        self.reqs: dict[str, Request] = {}
        self.ahead_steps = 0  # steps launched from the device's tokens
        self.held: list[int] = []  # blocks of ended requests while a step that has them runs
        execute = self.me.runner.execute

        def counting(batch, *a, input_ids=None, **k):
            self.ahead_steps += input_ids is not None
            return execute(batch, *a, input_ids=input_ids, **k)

        self.me.runner.execute = counting

    def submit(self, name: str, params: SamplingParams, eos=frozenset({2}), prompt=PROMPT):
        r = Request(name, list(prompt), params, eos, 0.0)
        self.got[name] = []
        r.sink = self.got[name].append
        self.reqs[name] = r
        self.me.add(r)
        return r

    def hook(self):
        self.me.flush_outputs(collect=False)
        self.held.extend(
            len(r.block_table)
            for r in self.me.scheduler.running
            if r.finish_reason is not None and not r.is_finished
        )

    def step(self) -> bool:
        return self.me.step(0.0, while_running=self.hook)

    def until_done(self, on_step=None):
        n = 0
        while self.me.has_work:
            self.step()
            n += 1
            if on_step is not None:
                on_step(n)
        self.me.flush_outputs()
        self.me.check_integrity()
        assert self.me.kv.allocator.num_used_blocks == 0

    def outcome(self, name: str):
        outs = self.got[name]
        r = self.reqs[name]
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert PENDING not in r.all_token_ids
        return (
            [t for o in outs for t in o.new_token_ids],
            "".join(o.new_text for o in outs),
            outs[-1].finish_reason,
            list(r.output_token_ids),
            [lp for o in outs for lp in o.logprobs or ()],
        )


def both(setup, on_step=None, make=tiny_cpu_worker) -> tuple[Run, Run]:
    """The same requests run with tokens read before each next step and launched ahead: each
    request's outcome is the same."""
    runs = []
    for ahead in (False, True):
        run = Run(ahead, make)
        setup(run)
        run.until_done(on_step(run) if on_step else None)
        runs.append(run)
    plain, ahead = runs
    for name in plain.got:
        assert ahead.outcome(name) == plain.outcome(name), name
    assert plain.ahead_steps == 0
    return plain, ahead


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_decode_steps_launch_ahead_with_the_same_tokens_and_text():
    def setup(run):
        run.submit("a", greedy(12))
        run.submit("b", greedy(5))  # ends by length first: the step after it leaves it out
        run.submit("c", SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7))

    _, ahead = both(setup)
    # a's 12 tokens take 12 steps: all but the first (the prefill) launched ahead
    assert ahead.ahead_steps == 11
    assert ahead.outcome("a")[2] is FinishReason.LENGTH


def greedy_output(n: int = 10, make=tiny_cpu_worker) -> list[int]:
    run = Run(False, make)
    run.submit("a", greedy(n))
    run.until_done()
    return run.outcome("a")[3]


def eos_in_the_unread_token(make=tiny_cpu_worker) -> None:
    out = greedy_output(make=make)
    k = next(i for i in range(2, len(out)) if out[i] not in out[:i])  # a fresh token
    eos = frozenset({out[k]})

    def setup(run):
        run.submit("a", SamplingParams(max_tokens=10, temperature=0), eos=eos)
        run.submit("b", greedy(10))

    plain, ahead = both(setup, make=make)
    ids, _, reason, output, _ = ahead.outcome("a")
    assert reason is FinishReason.STOP and output == out[: k + 1]
    assert ahead.held and all(n > 0 for n in ahead.held)
    assert ahead.outcome("b")[2] is FinishReason.LENGTH


@pytest.mark.slow
def test_eos_in_the_unread_token_ends_the_request_and_its_extra_step_is_dropped():
    """The EOS is only seen once the next step is launched: that step computes the request for
    nothing (its token dropped), the request keeps its blocks until that step is read, and the
    one sharing its steps runs on."""
    eos_in_the_unread_token()


def test_a_stop_string_ends_the_request_as_when_tokens_are_read_first():
    run = Run(False)
    run.submit("a", greedy(10))
    run.until_done()
    text = run.outcome("a")[1]
    cut = next(i for i in range(2, len(text)) if text[i] not in text[:i])

    def setup(run):
        run.submit("a", greedy(10, stop=(text[cut],)))
        run.submit("b", greedy(10))

    _, ahead = both(setup)
    assert ahead.outcome("a")[1] == text[:cut]
    assert ahead.outcome("a")[2] is FinishReason.STOP


def test_a_new_request_is_admitted_between_steps_launched_ahead():
    """A request that arrives while steps run ahead waits for the next usual step (the tokens
    are read first), then both run ahead again."""

    def setup(run):
        run.submit("a", greedy(12))

    def on_step(run):
        def arrive(n):
            if n == 4:
                run.submit("b", greedy(6), prompt=[9, 8, 7])

        return arrive

    _, ahead = both(setup, on_step)
    # a's 12 tokens take 12 steps: its prefill and the one that admits b are usual steps
    assert ahead.ahead_steps == 10


@pytest.mark.parametrize(
    "params",
    [
        greedy(10, presence_penalty=-2.0),  # negative: repeats are drawn in, so the last
        greedy(10, frequency_penalty=-2.0),  # token (the unread one) matters at once
        greedy(10, repetition_penalty=0.2),
    ],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_see_the_unread_token_and_launch_ahead_with_the_same_tokens(params):
    """The penalties read the output so far: launched ahead, the token not read yet is counted
    from the device, and the outputs are those of steps that read their tokens first."""

    def setup(run):
        run.submit("a", params)
        run.submit("b", greedy(10))  # unpenalized, sharing the steps

    plain, ahead = both(setup)
    assert ahead.ahead_steps == 9
    assert plain.outcome("a")[3] != plain.outcome("b")[3]  # the penalty changed the output


@pytest.mark.slow
def test_logit_bias_and_min_tokens_launch_ahead_with_the_same_tokens():
    """A bias against the token a request would pick second, and a min_tokens that bans the EOS
    (the token it would pick third) through its fifth token, counting the unread token: the
    same outputs as when the tokens are read first."""
    out = greedy_output(8)
    eos = out[2]

    def setup(run):
        run.submit("a", greedy(8, logit_bias=((out[1], -100.0),)))
        run.submit(
            "b", SamplingParams(max_tokens=8, temperature=0, min_tokens=5), eos=frozenset({eos})
        )

    plain, ahead = both(setup)
    assert ahead.ahead_steps == 7
    assert out[1] not in ahead.outcome("a")[3][1:2]  # the bias moved its second token
    tokens_b = ahead.outcome("b")[3]
    assert len(tokens_b) >= 5 and eos not in tokens_b[:5]  # its third token, without the ban


@pytest.mark.slow
def test_logprobs_come_back_with_the_tokens_launched_ahead():
    """Logprobs are computed on the device beside the token and read with it: the same values
    as when the tokens are read first, top alternatives included (and none where none asked)."""

    def setup(run):
        run.submit("a", greedy(8, logprobs=3))
        run.submit("b", greedy(8, logprobs=0))
        run.submit("c", greedy(8))

    _, ahead = both(setup)
    assert ahead.ahead_steps == 7
    lps = {n: ahead.outcome(n)[4] for n in "abc"}
    assert len(lps["a"]) == 8 and all(len(lp.top) == 3 for lp in lps["a"])
    assert all(lp.top == [] for lp in lps["b"]) and lps["c"] == []
    assert [lp.token_id for lp in lps["a"]] == ahead.outcome("a")[3]


@pytest.mark.slow
def test_an_abort_reads_the_step_in_flight_first_and_frees_everything():
    run = Run(True)
    a = run.submit("a", greedy(20))
    b = run.submit("b", greedy(20))
    for _ in range(5):
        run.step()
    assert run.me._ahead is not None and run.ahead_steps >= 3
    run.me.abort(a.request_id)
    assert run.me._ahead is None
    assert a.finish_reason is FinishReason.ABORT and a.is_finished and not a.block_table
    assert PENDING not in a.all_token_ids
    run.until_done()
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 20


def test_a_failure_while_running_ahead_ends_each_request_once_with_the_error():
    run = Run(True)
    run.submit("a", greedy(20))
    run.submit("b", greedy(20))
    launch = run.me.sampler.launch
    calls = []

    def failing(logits, reqs, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the device failed")
        return launch(logits, reqs, **kw)

    run.me.sampler.launch = failing
    run.until_done()
    for name in "ab":
        outs = run.got[name]
        finals = [o for o in outs if o.finished]
        assert [o.finish_reason for o in finals] == [FinishReason.ERROR]
        assert "the device failed" in finals[0].error
        assert run.reqs[name].is_finished and not run.reqs[name].block_table


def test_a_request_near_the_model_length_stops_launching_ahead_at_the_limit():
    """max_model_len ends a request by length: the step after its last token is never launched
    (it would write past its last position)."""
    me_len = 24
    for ahead in (False, True):
        run = Run(ahead)
        s = run.me.scheduler
        s.config = type(s.config)(**{**s.config.__dict__, "max_model_len": me_len})
        run.me.outputs.max_model_len = me_len
        r = run.submit("a", greedy(100), prompt=list(range(3, 3 + 20)))
        run.until_done()
        assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == me_len
