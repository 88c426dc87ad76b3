"""Structured output: response_format (json_object, json_schema) and vLLM's guided_* fields,
compiled with xgrammar and applied as a token bitmask in the sampler. The outputs are checked
against their schemas, through the official openai client and LangChain too; a grammar that does
not compile, or a malformed request, gets 400 with the envelope."""

from __future__ import annotations

import json
import queue
import re
import time

import httpx
import jsonschema
import pytest
import torch

from models.loader import ModelSource, model_dir
from models.tokenizer import load_tokenizer
from prism_server import envs
from prism_server.completion import Completion
from prism_server.config import EngineConfig, ModelSpec
from prism_server.engine.engine import Engine
from prism_server.grammar import Grammars, GrammarSpec, Guides
from prism_server.served_model import RequestRejected
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

CHAT = "smollm2-135m"
Q = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "in_europe": {"type": "boolean"},
                },
                "required": ["name", "in_europe"],
            },
        },
        "required": ["city", "country"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
            "sure": {"type": "boolean"},
        },
        "required": ["answer", "sure"],
    },
    "array": {
        "type": "object",
        "properties": {
            "cities": {
                "type": "array",
                "items": {"type": "string", "maxLength": 15},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["cities"],
    },
}


def _rf(name: str) -> dict:
    schema = {"name": name, "schema": SCHEMAS[name], "strict": True}
    return {"type": "json_schema", "json_schema": schema}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(server, **fields) -> dict:
    body = {"model": CHAT, "messages": Q, "max_tokens": 80, "temperature": 0, **fields}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the mask and the matchers, on random logits (no model) -----------------------------------
@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer(model_dir(ModelSource.parse(CHAT), envs.gguf_cache_dir()))
    return Grammars(tok, 49152, {tok.eos_token_id}), tok


def _req(rid: str, grammar) -> Request:
    params = SamplingParams(max_tokens=400, temperature=0, grammar=grammar)
    return Request(rid, [1, 2, 3], params, frozenset({2}), 0.0)


def test_masked_rows_follow_their_grammars_and_the_free_row_is_untouched(grammars):
    g, tok = grammars
    schema = g.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS["enum"])))
    regex = g.compile(GrammarSpec("regex", "[0-9]{3}-[0-9]{4}", param="guided_regex"))
    reqs = [_req("a", schema), _req("free", None), _req("b", regex)]
    guides, out, done = Guides(), {"a": [], "b": []}, set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        live = [r for r in reqs if r.request_id not in done]
        logits = torch.randn(len(live), 49152, generator=gen)
        before = logits.clone()
        guides.mask(logits, live)
        for i, r in enumerate(live):
            if r.params.grammar is None:
                assert torch.equal(logits[i], before[i])
        tokens = logits.argmax(-1).tolist()
        finished = guides.accept(live, tokens)
        for r, t in zip(live, tokens):
            if r.request_id in out:
                out[r.request_id].append(t)
        done |= finished
        if {"a", "b"} <= done:
            break
    assert {"a", "b"} <= done  # both grammars completed, each with the stop token
    assert out["a"][-1] == out["b"][-1] == tok.eos_token_id
    jsonschema.validate(json.loads(tok.decode(out["a"][:-1])), SCHEMAS["enum"])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", tok.decode(out["b"][:-1]))
    with pytest.raises(RuntimeError, match="breaks the grammar"):
        guides.accept([_req("c", regex)], [tok.eos_token_id])  # nothing matched yet


def test_a_grammar_that_does_not_compile_names_the_problem(grammars):
    g, _ = grammars
    with pytest.raises(RequestRejected, match='response_format cannot be compiled: .*"objec"'):
        g.compile(GrammarSpec("json_schema", '{"type": "objec"}'))
    with pytest.raises(RequestRejected, match="guided_grammar cannot be compiled") as e:
        g.compile(GrammarSpec("ebnf", "root ::= ", param="guided_grammar"))
    assert e.value.param == "guided_grammar"


# ---- through the server ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_streamed_or_not(server, name):
    body = chat(server, response_format=_rf(name))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
    req = {"model": CHAT, "messages": Q, "max_tokens": 80, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={**req, "response_format": _rf(name)},
        timeout=120,
    ) as r:
        lines = [
            ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"
        ]
    deltas = [json.loads(x)["choices"] for x in lines]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == choice["message"]["content"]


@pytest.mark.slow
def test_sampled_choices_each_keep_the_schema(server):
    body = chat(server, response_format=_rf("enum"), n=3, temperature=1.0, seed=7)
    for c in body["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMAS["enum"])


def test_guided_choice_regex_and_json_object(server):
    body = chat(
        server,
        guided_choice=["yes", "no"],
        messages=[{"role": "user", "content": "Is the sky blue?"}],
    )
    assert body["choices"][0]["message"]["content"] in ("yes", "no")
    r = post(
        server,
        "/v1/completions",
        {
            "model": CHAT,
            "prompt": "Phone:",
            "max_tokens": 20,
            "temperature": 0,
            "guided_regex": "[0-9]{3}-[0-9]{4}",
        },
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"]), r.text
    # json_object: whatever the model writes is JSON from its first token on
    body = chat(server, response_format={"type": "json_object"}, max_tokens=12)
    text = body["choices"][0]["message"]["content"]
    assert text.startswith("{") and not text.startswith("{ "), text


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            "response_format",
            "Unsupported type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
        ({"guided_json": "[1, 2]"}, "guided_json", "JSON schema object"),
        (
            {"guided_regex": "(", "response_format": {"type": "json_object"}},
            "guided_regex",
            "Only one kind",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", "min_tokens"),
    ],
)
def test_malformed_structured_output_is_refused_with_400(server, fields, param, message):
    r = post(
        server, "/v1/chat/completions", {"model": CHAT, "messages": Q, "max_tokens": 4, **fields}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    chat(server, max_tokens=2)  # and it keeps serving


@pytest.mark.slow
def test_the_openai_client_and_langchain_get_objects_that_validate(server):
    from langchain_openai import ChatOpenAI
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=CHAT, messages=Q, max_tokens=80, temperature=0, response_format=_rf("enum")
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["enum"])
    llm = ChatOpenAI(
        model=CHAT, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=80
    )
    for name in sorted(SCHEMAS):
        schema = {"title": name, "description": f"the {name} answer", **SCHEMAS[name]}
        out = llm.with_structured_output(schema, method="json_schema").invoke(Q[0]["content"])
        jsonschema.validate(out, SCHEMAS[name])


def test_constrained_requests_preempted_and_recomputed_keep_their_grammars():
    """Four JSON-schema requests at once in KV room for about two: requests are preempted
    (their KV freed, their tokens recomputed on resume) while their matchers keep their state;
    each output is the one it gets alone, and valid."""
    spec = ModelSpec(CHAT, CHAT, block_size=16, max_model_len=512)
    cfg = EngineConfig(models=(spec,), device="cpu", page_bytes=1 << 20,
                       kv_budget_bytes=12 << 20, reserve_output_tokens=0)  # fmt: skip
    with Engine(cfg) as e:
        served = e.model(CHAT)
        names = ["nested", "enum", "array", "nested"]
        params = [
            SamplingParams(
                max_tokens=60,
                temperature=0,
                grammar=served.compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMAS[n]))),
            )
            for n in names
        ]
        prompts = [
            served.encode_chat([{"role": "user", "content": f"{i}: a city, as JSON."}], True)
            for i in range(len(names))
        ]
        alone = [e.generate(CHAT, [p], sp)[0] for p, sp in zip(prompts, params)]
        before = e.model_snapshot(CHAT).num_preemptions
        together = _generate_all(e, prompts, params)
        assert e.model_snapshot(CHAT).num_preemptions > before  # it did preempt
        for n, a, t in zip(names, alone, together):
            assert t.token_ids == a.token_ids
            jsonschema.validate(json.loads(t.text), SCHEMAS[n])
        e.check_integrity()


def _generate_all(e, prompts, params):
    """The prompts at once, each with its own sampling parameters; waits for all."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    out = []
    for p, sp in zip(prompts, params):
        c = Completion(p, arrival_time=time.monotonic())

        def sink(o, c=c):
            c.add(o, time.monotonic())
            if o.finished:
                done.put(None)

        e.add_request(CHAT, p, sp, sink)
        out.append(c)
    for _ in out:
        done.get(timeout=300)
    return out
