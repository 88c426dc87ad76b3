"""The engine end to end on CPU: batching, chunked prefill, preemption, sharing one pool."""

from __future__ import annotations

import json

import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.request import FinishReason
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

SMOL = "smollm2-135m"
# SmolLM2 in fp32 takes 30 x 24 KiB = 720 KiB of KV per 16-token block: a 4 MiB page holds 5
# blocks (80 tokens), so these prompts span several blocks and pages.
PAGE = 4 << 20

TOPICS = [
    "the sea",
    "a city at night",
    "mountains",
    "bread",
    "a small robot",
    "the moon",
    "trains",
    "winter",
    "a library",
    "music",
    "bees",
    "an old map",
    "rain",
    "chess",
    "a garden",
    "the desert",
]


def prompts() -> list[str]:
    return [
        f"Write {i % 4 + 1} sentences about {t}." + " Be vivid." * (i % 5)
        for i, t in enumerate(TOPICS)
    ]


def smol_engine(budget_pages: int, reserve_output_tokens: int | None = None, **spec) -> Engine:
    # SLOs no step can miss: the arbitrator then admits in arrival order and never shortens a
    # chunk, so how the steps go (and how often blocks run out) does not depend on the machine's
    # speed (the default SLOs are multiples of the start-up profile, which a loaded machine skews)
    spec = ModelSpec(SMOL, SMOL, **{"ttft_slo_ms": 1e9, "tpot_slo_ms": 1e9, **spec})
    return Engine(
        EngineConfig(
            models=(spec,),
            device="cpu",
            page_bytes=PAGE,
            kv_budget_bytes=budget_pages * PAGE,
            reserve_output_tokens=reserve_output_tokens,
        )
    )


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def sequential() -> list[list[int]]:
    with smol_engine(64) as e:
        out = [e.generate(SMOL, [p], GREEDY)[0].token_ids for p in prompts()]
        e.check_integrity()
    return out


def test_batched_equals_sequential(sequential):
    with smol_engine(64) as e:
        outs = e.generate(SMOL, prompts(), GREEDY)
        assert [o.token_ids for o in outs] == sequential
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        assert e.model_snapshot(SMOL).num_preemptions == 0
        e.check_integrity()


def test_batched_equals_sequential_under_preemption_and_chunked_prefill(sequential, steps_ahead):
    # 5 usable pages = 400 tokens of KV for 16 requests of ~20-60 + 20 tokens each; prompts are
    # prefilled in chunks of at most 32 tokens. Greedy admission (no output reserved), so that
    # blocks run out mid-decode.
    with smol_engine(6, reserve_output_tokens=0, max_num_batched_tokens=32) as e:
        outs = e.generate(SMOL, prompts(), GREEDY)
        assert [o.token_ids for o in outs] == sequential
        assert e.model_snapshot(SMOL).num_preemptions > 0
        e.check_integrity()
        snap = e.model_snapshot(SMOL)  # no request holds a block; the prefix cache keeps some
        assert snap.kv_blocks_used == snap.kv_blocks_prefix_idle > 0


def test_prompt_logprobs_are_the_same_in_chunks_and_under_preemption():
    """Each prompt token after the first gets one logprob (with its top 3), whether the prompt
    is prefilled whole or in chunks of 32 tokens, and once only when a preempted request
    recomputes its prompt."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with smol_engine(64) as e:
        whole = e.generate(SMOL, prompts(), params)
        e.check_integrity()
    with smol_engine(6, reserve_output_tokens=0, max_num_batched_tokens=32) as e:
        chunked = e.generate(SMOL, prompts(), params)
        assert e.model_snapshot(SMOL).num_preemptions > 0
        e.check_integrity()
    for w, c in zip(whole, chunked):
        assert len(w.prompt_logprobs) == len(w.prompt_token_ids) - 1
        assert [x.token_id for x in w.prompt_logprobs] == w.prompt_token_ids[1:]
        assert all(len(x.top) == 3 and x.top[0][1] >= x.logprob - 1e-4 for x in w.prompt_logprobs)
        assert [x.token_id for x in c.prompt_logprobs] == w.prompt_token_ids[1:]
        assert [x.logprob for x in c.prompt_logprobs] == pytest.approx(
            [x.logprob for x in w.prompt_logprobs], abs=1e-3
        )


def test_abort_mid_decode_frees_the_blocks():
    import queue

    with smol_engine(16) as e:
        q: queue.SimpleQueue = queue.SimpleQueue()
        req = e.add_request(
            SMOL,
            "Count to one hundred:",
            SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
            sink=q.put,
        )
        for _ in range(3):
            assert not q.get(timeout=60).finished
        e.abort(SMOL, req.request_id)
        while not (out := q.get(timeout=60)).finished:
            pass
        assert out.finish_reason is FinishReason.ABORT and out.num_output_tokens < 200
        e.check_integrity()
        assert e.model_snapshot(SMOL).kv_blocks_held == 0


def test_requests_that_can_never_fit_are_refused_up_front():
    with smol_engine(4, max_model_len=64) as e:
        with pytest.raises(ValueError, match="maximum context length is 64"):
            e.add_request(SMOL, "hello " * 60, SamplingParams(max_tokens=16))
        with pytest.raises(ValueError, match="prompt is empty"):
            e.add_request(SMOL, [], SamplingParams(max_tokens=16))
        e.check_integrity()


def test_stop_strings_and_stop_tokens_end_the_output():
    with smol_engine(16) as e:
        base = e.generate(
            SMOL, ["The alphabet: A, B, C,"], SamplingParams(max_tokens=12, temperature=0)
        )[0]
        assert len(base.text) > 6
        stop = base.text[3:6]
        cut = e.generate(
            SMOL,
            ["The alphabet: A, B, C,"],
            SamplingParams(max_tokens=12, temperature=0, stop=(stop,)),
        )[0]
        assert cut.finish_reason is FinishReason.STOP and cut.text == base.text[:3]
        tok = base.token_ids[2]
        by_id = e.generate(
            SMOL,
            ["The alphabet: A, B, C,"],
            SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(tok,)),
        )[0]
        assert by_id.finish_reason is FinishReason.STOP
        assert by_id.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
        e.check_integrity()


def test_two_models_share_one_pool():
    """A holds most of the pool after its burst; B's burst is then served by pages A gives back."""
    a = ModelSpec("a", "dummy:tiny-llama", block_size=4, max_cached_pages=64, seed=1)
    b = ModelSpec("b", "dummy:tiny-llama", block_size=4, max_cached_pages=64, seed=2)
    page = 64 << 10
    with Engine(
        EngineConfig(models=(a, b), device="cpu", page_bytes=page, kv_budget_bytes=11 * page)
    ) as e:
        bpp = e.worker.models["a"].kv.allocator.bpp
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        long_prompt = list(range(10, 10 + 4 * bpp - 8))  # fills 1 page once its output is in
        outs = e.generate("a", [long_prompt] * 8, params)  # 8 of the 10 pages
        assert all(len(o.token_ids) == 8 for o in outs)
        e.check_integrity()
        assert e.pool.pages_of("a") == 8 and e.pool.num_available == 2
        burst = [[11 + i, *long_prompt[1:]] for i in range(9)]  # no prefix shared
        alone = [e.generate("b", [p], params)[0].token_ids for p in burst]
        outs = e.generate("b", burst, params)
        assert [o.token_ids for o in outs] == alone
        e.check_integrity()
        assert e.pool.pages_of("a") < 8 and e.pool.pages_of("b") >= 2


def test_a_step_of_only_partial_prefill_chunks_samples_nothing():
    spec = ModelSpec("t", "dummy:tiny-llama", block_size=4, max_num_batched_tokens=8)
    with Engine(
        EngineConfig(models=(spec,), device="cpu", page_bytes=64 << 10, kv_budget_bytes=2 << 20)
    ) as e:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        out = e.generate("t", [list(range(10, 40))], params)[0]  # 30 tokens: 4 chunks
        assert out.error is None and len(out.token_ids) == 3
        e.check_integrity()


def test_the_step_trace_records_every_step_with_its_shape_and_estimate(tmp_path):
    specs = tuple(
        ModelSpec(n, "dummy:tiny-llama", block_size=4, max_num_batched_tokens=8, seed=i)
        for i, n in enumerate("ab")
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    trace = str(tmp_path / "steps.jsonl")
    config = EngineConfig(
        models=specs, device="cpu", page_bytes=64 << 10, kv_budget_bytes=2 << 20, step_trace=trace
    )
    with Engine(config) as e:
        e.generate("a", [list(range(10, 40))], params)  # 30 tokens: 4 chunks, then 2 decodes
        e.generate("b", [list(range(10, 20)), list(range(20, 25))], params)
        e.check_integrity()
    steps = e.worker.steps  # once its thread has stopped (a step is counted after it publishes)
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl.cpu").read_text().splitlines()]
    assert len(lines) == steps
    a = [x for x in lines if x["model"] == "a"]
    assert [x["tokens"] for x in a] == [8, 8, 8, 6, 1, 1]
    assert [x["seqs"] for x in a] == [1] * 6 and a[-1]["kv"] == a[-1]["attn"] == 32
    assert {x["model"] for x in lines} == {"a", "b"}
    assert sum(x["tokens"] for x in lines if x["model"] == "b") == 15 + 2 * 2
    assert all(x["s"] >= x["run_s"] > 0 and x["est_s"] > 0 for x in lines)
    assert all(a["t"] + a["s"] <= b["t"] for a, b in zip(lines, lines[1:]))
