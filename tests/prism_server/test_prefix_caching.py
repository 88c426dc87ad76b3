"""Prefix caching: a multi-turn chat replayed turn by turn gives the same greedy outputs with the
cache and without it; from the second turn on the prompt's history is found cached and only the
new tokens are computed (counted); the usage and the metrics say so; under memory pressure idle
cached blocks go before any request is preempted, for the model's own requests and for another
model's. Every test ends with the integrity check."""

from __future__ import annotations

import httpx
import pytest

from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from scheduler.sampling_params import SamplingParams

SMOL = "smollm2-135m"
QUESTIONS = [
    "Name a fruit.",
    "What colour is it?",
    "Where does it grow?",
    "Is it sweet?",
    "Name another one.",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def chat_turns(e: Engine) -> list[tuple[int, int, int, int, str]]:
    """Each turn's (prompt tokens, cached tokens, tokens computed for it, tokens generated,
    answer)."""
    served = e.served[SMOL]
    sched = e.worker.models[SMOL].scheduler
    messages, out = [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        ids = served.encode_chat(messages)
        before = sched.tokens_computed
        (c,) = e.generate(SMOL, [ids], GREEDY)
        computed = sched.tokens_computed - before
        out.append((len(ids), c.num_cached_tokens, computed, len(c.token_ids), c.text))
        messages.append({"role": "assistant", "content": c.text})
    e.check_integrity()
    return out


def engine(prefix: bool, **cfg) -> Engine:
    spec = ModelSpec(SMOL, SMOL)
    return Engine(
        EngineConfig(
            models=(spec,),
            device="cpu",
            page_bytes=4 << 20,
            kv_budget_bytes=64 << 20,
            enable_prefix_caching=prefix,
            **cfg,
        )
    )


@pytest.mark.slow
def test_a_multi_turn_chat_reuses_its_history_and_answers_the_same():
    with engine(prefix=False) as e:
        plain = chat_turns(e)
        assert e.model_snapshot(SMOL).prefix_cache_queries == 0
    with engine(prefix=True) as e:
        cached = chat_turns(e)
        snap = e.model_snapshot(SMOL)
    assert [t[4] for t in cached] == [t[4] for t in plain]  # the same greedy answers
    assert [t[0] for t in cached] == [t[0] for t in plain]
    assert all(t[1] == 0 for t in plain) and cached[0][1] == 0
    for prompt, _hit, computed, generated, _ in plain:  # the whole prompt, then each decode step
        assert computed == prompt + generated - 1
    for prompt, hit, computed, generated, _ in cached[1:]:
        # the history was cached, block by block: only the new turn's tokens are computed
        assert hit > 0 and hit % 16 == 0 and prompt - hit < 16 + 40, (prompt, hit)
        assert computed == prompt - hit + generated - 1
    assert snap.prefix_cache_hits == sum(t[1] for t in cached) > 0
    assert snap.prefix_cache_queries == sum(t[0] for t in cached)
    assert snap.kv_blocks_prefix_idle > 0  # nobody runs: what is left is the idle cache


@pytest.mark.slow
def test_the_usage_and_the_metrics_report_cached_tokens(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Tell me about the history of the bicycle. " * 6}]
    first = client.chat.completions.create(
        model=SMOL, messages=messages, max_tokens=8, temperature=0
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the tandem?"},
    ]
    second = client.chat.completions.create(
        model=SMOL, messages=messages, max_tokens=8, temperature=0
    )
    # the first turn may share the template's system prompt with earlier requests; the second
    # finds the whole first turn, block by block
    before = first.usage.prompt_tokens_details.cached_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert before < cached < second.usage.prompt_tokens, (first.usage, second.usage)
    assert cached >= first.usage.prompt_tokens // 16 * 16
    metrics = httpx.get(server.url + "/metrics").text
    hits = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith(f'prism:prefix_cache_hits_total{{model_name="{SMOL}"')
    ]
    assert hits and hits[0] >= cached, metrics[:2000]


PAGE = 64 << 10


def tiny(name: str, seed: int) -> ModelSpec:
    return ModelSpec(name, "dummy:tiny-llama", block_size=4, seed=seed, max_cached_pages=1)


def prompts(n: int, length: int, start: int) -> list[list[int]]:
    """n prompts that share no block."""
    return [[10 + (start + i * 7 + j) % 400 for j in range(length)] for i in range(n)]


@pytest.mark.parametrize("policy", ["prism", "static"])
def test_idle_cached_blocks_go_before_any_request_is_preempted(policy):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cfg = EngineConfig(
        models=(tiny("a", 1),),
        device="cpu",
        page_bytes=PAGE,
        kv_budget_bytes=12 * PAGE,
        reserve_output_tokens=0,
        policy=policy,
    )
    with Engine(cfg) as e:
        bpp = e.worker.models["a"].kv.allocator.bpp
        length = 4 * bpp - 8  # with its output, one page
        e.generate("a", prompts(8, length, 0), params)
        idle = e.model_snapshot("a").kv_blocks_prefix_idle
        assert idle >= 6 * bpp  # their prompts stay cached
        e.check_integrity()
        outs = e.generate("a", prompts(11, length, 1000), params)  # new prompts: all the pool
        snap = e.model_snapshot("a")
        assert all(len(o.token_ids) == 8 for o in outs)
        assert snap.num_preemptions == 0, snap
        assert e.worker.models["a"].kv.allocator.prefix.evictions >= 6 * bpp  # most of the cache
        e.check_integrity()


def test_another_models_idle_cache_is_reclaimed_before_anyone_is_preempted_or_evicted():
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cfg = EngineConfig(
        models=(tiny("a", 1), tiny("b", 2)),
        device="cpu",
        page_bytes=PAGE,
        kv_budget_bytes=12 * PAGE,
        reserve_output_tokens=0,
    )
    with Engine(cfg) as e:
        bpp = e.worker.models["a"].kv.allocator.bpp
        length = 4 * bpp - 8
        e.generate("a", prompts(8, length, 0), params)
        idle = e.model_snapshot("a").kv_blocks_prefix_idle
        assert idle >= 6 * bpp
        outs = e.generate("b", prompts(10, length, 1000), params)  # needs most of a's pages
        a, b = e.model_snapshot("a"), e.model_snapshot("b")
        assert all(len(o.token_ids) == 8 for o in outs)
        assert a.kv_blocks_prefix_idle < idle  # a's cache gave its pages
        assert e.worker.models["a"].kv.allocator.prefix.evictions > 0
        assert a.evictions == 0 and a.num_preemptions == 0 and b.num_preemptions == 0
        e.check_integrity()
