"""A step's tokens leave their text to the next step's launch (the host renders while the device
runs): the order of every request's deltas, the flush when nothing else runs, and a stop string
found in that text one step late, whose request ends there with the token computed meanwhile
dropped, the KV accounting exact."""

from __future__ import annotations

import pytest

from scheduler.request import FinishReason, Request
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import tiny_cpu_worker


def worker():
    return tiny_cpu_worker()


def submit(me, name: str, params: SamplingParams, log: list) -> Request:
    r = Request(name, [5, 6, 7, 8, 9], params, frozenset({2}), 0.0)
    r.sink = lambda out: log.append((name, out))
    me.add(r)
    return r


def run(me, deferred: bool, events: list, held: list | None = None) -> None:
    """Steps until nothing is left, recording each hook call among the deltas; held: the block
    counts that requests ended during a step still hold until the step is done."""

    def hook():
        events.append(("hook", None))
        me.flush_outputs()
        if held is not None:
            held.extend(
                len(r.block_table)
                for r in me.scheduler.running
                if r.finish_reason is not None and not r.is_finished
            )

    while me.has_work:
        me.step(0.0, while_running=hook if deferred else None)
    me.flush_outputs()


def test_text_comes_one_step_later_in_order_and_the_same():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain: list = []
    me = worker()
    submit(me, "a", params, plain)
    run(me, False, [])
    me2 = worker()
    deferred: list = []
    submit(me2, "a", params, deferred)
    run(me2, True, deferred)
    outs = [o for _, o in plain]
    later = [o for k, o in deferred if k == "a"]
    assert [o.new_token_ids for o in later] == [o.new_token_ids for o in outs]
    assert "".join(o.new_text for o in later) == "".join(o.new_text for o in outs)
    assert later[-1].finished and later[-1].finish_reason is FinishReason.LENGTH
    # each token's delta comes in the next step's hook (the last one, ending its request, at once)
    kinds = [k for k, _ in deferred]
    assert kinds[0] == "hook" and kinds.count("a") == 6
    for i, k in enumerate(kinds[1:-1], start=1):
        if k == "a":
            assert kinds[i - 1] == "hook"
    me2.check_integrity()


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def stop_after_a_few_tokens() -> tuple[str, int, SamplingParams]:
    """The greedy text of request "a" alone, where a stop string would cut it (a character not
    seen before, after at least two), and the params that stop there."""
    me = worker()
    base: list = []
    submit(me, "a", GREEDY, base)
    run(me, False, [])
    text = "".join(o.new_text for _, o in base)
    cut = next(i for i in range(2, len(text)) if text[i] not in text[:i])  # a fresh character
    stop = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=(text[cut],))
    return text, cut, stop


@pytest.mark.parametrize("company", [True, False], ids=["shared-steps", "alone"])
def test_a_stop_string_found_a_step_late_ends_the_request_as_at_once_and_drops_the_extra_token(
    company,
):
    """The same request with a stop string, its text made at once and a step late: the same
    deltas, tokens and ending; the token computed meanwhile is dropped (alone: nothing of its
    step is sampled), and a request sharing the steps runs on."""
    text, cut, params = stop_after_a_few_tokens()
    results = {}
    for deferred in (False, True):
        me = worker()
        got: list = []
        other = submit(me, "b", GREEDY, got) if company else None  # shares the steps
        r = submit(me, "a", params, got)
        held: list = []
        run(me, deferred, [], held)
        # ended by its text during a step, it kept its blocks until the step was done
        assert (held and all(n > 0 for n in held)) if deferred else not held
        assert not r.block_table
        mine = [o for n, o in got if n == "a"]
        if other is not None:  # it runs on to its end
            assert other.finish_reason is FinishReason.LENGTH and other.num_output_tokens == 8
        me.check_integrity()
        results[deferred] = (
            [o.new_token_ids for o in mine],
            [o.new_text for o in mine],
            mine[-1].finish_reason,
            list(r.output_token_ids),
        )
    assert results[True] == results[False]
    ids, texts, reason, output = results[True]
    assert reason is FinishReason.STOP and "".join(texts) == text[:cut]
    assert output == [t for x in ids for t in x] and len(output) < 8  # nothing past the stop


def test_a_step_that_fails_after_a_request_ended_by_its_text_ends_each_request_once():
    """A stop string ends one request while the step runs, then the step fails: that request
    keeps its one ending (stop), the others end with the error, every block comes back."""
    _, _, params = stop_after_a_few_tokens()
    me = worker()
    got: list = []
    other = submit(me, "b", GREEDY, got)
    r = submit(me, "a", params, got)
    sample, ended = me.sampler.sample, []

    def failing(logits, reqs):
        if r.finish_reason is not None and not ended:
            ended.append(True)
            raise RuntimeError("the device failed")
        return sample(logits, reqs)

    me.sampler.sample = failing

    def hook():
        me.flush_outputs()

    while me.has_work:
        me.step(0.0, while_running=hook)
    me.flush_outputs()
    assert ended
    finals = {n: [o for m, o in got if m == n and o.finished] for n in "ab"}
    assert [o.finish_reason for o in finals["a"]] == [FinishReason.STOP]
    assert [o.finish_reason for o in finals["b"]] == [FinishReason.ERROR]
    assert other.is_finished and r.is_finished
    me.check_integrity()
