"""Request fields: the sampling fields clients send work (a test shows each one's effect), the
ones Prism does not honour are refused with 400 and the envelope (never dropped in silence), and
vLLM's utility endpoints (/tokenize, /detokenize, /version)."""

from __future__ import annotations

import json

import httpx
import pytest

from prism_server import __version__

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine

CHAT = "smollm2-135m"
Q = [{"role": "user", "content": "What is the capital of France?"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(server, **fields) -> dict:
    body = {"model": CHAT, "messages": Q, "max_tokens": 6, "temperature": 0, **fields}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def first_token(server, text: str) -> int:
    r = post(server, "/tokenize", {"model": CHAT, "prompt": text, "add_special_tokens": False})
    return r.json()["tokens"][0]


def test_logit_bias_against_the_greedy_answers_first_token_changes_it(server):
    plain = chat(server)["choices"][0]["message"]["content"]
    tok = first_token(server, plain)
    biased = chat(server, logit_bias={str(tok): -100})["choices"][0]["message"]["content"]
    assert biased and first_token(server, biased) != tok, (plain, biased)
    forced = chat(server, logit_bias={"28": 100}, max_tokens=3)  # one token, every step
    text = forced["choices"][0]["message"]["content"]
    r = post(server, "/detokenize", {"model": CHAT, "tokens": [28, 28, 28]})
    assert text == r.json()["prompt"]


def test_repetition_penalty_and_min_p_change_what_is_sampled(server):
    long = {"max_tokens": 40, "ignore_eos": True}
    plain = chat(server, **long)["choices"][0]["message"]["content"]
    penalized = chat(server, repetition_penalty=2.0, **long)["choices"][0]["message"]["content"]
    assert penalized != plain
    # min_p = 1 keeps only the most likely token: sampling at temperature 2 is then greedy
    hot = chat(server, temperature=2.0, min_p=1.0, seed=5, **long)
    assert hot["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"stop_token_ids": [99999999], "min_tokens": 2}, "stop_token_ids"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        (
            {
                "messages": [
                    *Q,
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
                ]
            },
            "messages.1.tool_calls.0",
        ),
        ({"messages": [*Q, {"role": "tool", "content": "4"}]}, "messages.1.tool_call_id"),
    ],
)
def test_fields_it_cannot_honour_are_refused_with_400(server, fields, param):
    body = {"model": CHAT, "messages": Q, "max_tokens": 4, **fields}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_their_no_op_values_are_accepted(server):
    chat(server, tool_choice="none", response_format={"type": "text"}, priority=0, tools=[])
    chat(server, priority=3)  # honoured: it breaks ties between equal deadlines


@pytest.mark.parametrize(
    "fields, param", [({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix")]
)
def test_completion_fields_it_cannot_honour_are_refused(server, fields, param):
    body = {"model": CHAT, "prompt": "The sky is", "max_tokens": 4, **fields}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/v1/completions", {**body, **{k: None for k in fields}, "best_of": 1})
    assert r.status_code == 200, r.text


def test_tokenize_and_detokenize_round_trip_and_match_the_prompt_tokens(server):
    r = post(
        server, "/tokenize", {"model": CHAT, "prompt": "Hello world", "return_token_strs": True}
    )
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    back = post(server, "/detokenize", {"model": CHAT, "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    r = post(server, "/tokenize", {"model": CHAT, "messages": Q})
    usage = chat(server)["usage"]
    assert r.json()["count"] == usage["prompt_tokens"]  # what the chat endpoint prefills
    assert post(server, "/tokenize", {"model": CHAT}).status_code == 400
    assert post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    r = post(server, "/detokenize", {"model": CHAT, "tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    v = httpx.get(server.url + "/version").json()
    assert v == {"version": __version__}


def test_echo_returns_the_prompt_as_sent_without_bos(server):
    body = {"model": "gemma3-270m", "prompt": "The sky is", "max_tokens": 3, "echo": True}
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert text.startswith("The sky is") and "<bos>" not in text, text
    ids = post(server, "/tokenize", {"model": "gemma3-270m", "prompt": "The sky is"}).json()
    r = post(server, "/v1/completions", {**body, "prompt": ids["tokens"]})
    assert r.json()["choices"][0]["text"].startswith("<bos>The sky is")  # ids echoed as sent


def _cmpl(server, **fields) -> dict:
    body = {"max_tokens": 3, "temperature": 0, **fields}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("model", [CHAT, "gemma3-270m"])  # without a BOS, and with one
def test_echo_with_logprobs_scores_the_prompt_as_generation_scores_its_tokens(server, model):
    """A prompt token's logprob is what the model gave it when it generated it: extend the
    prompt by its greedy continuation and the echoed logprobs of those tokens match."""
    gen = _cmpl(server, model=model, prompt="The sky is", logprobs=2)
    full = "The sky is" + gen["text"]
    echoed = _cmpl(server, model=model, prompt=full, logprobs=2, echo=True, max_tokens=1)
    lp = echoed["logprobs"]
    assert echoed["text"].startswith(full)
    n = len(gen["logprobs"]["tokens"])
    k = len(lp["tokens"]) - 1 - n  # the prompt's tokens before the continuation
    assert lp["tokens"][k : k + n] == gen["logprobs"]["tokens"]
    assert lp["token_logprobs"][k : k + n] == pytest.approx(
        gen["logprobs"]["token_logprobs"], abs=1e-3
    )
    for got, want in zip(lp["top_logprobs"][k : k + n], gen["logprobs"]["top_logprobs"]):
        assert got.keys() == want.keys()
    assert "".join(lp["tokens"]) == echoed["text"]  # no BOS among them
    assert lp["text_offset"][0] == 0
    first = lp["token_logprobs"][0]
    assert (first is None) == (model == CHAT)  # SmolLM2 adds no BOS: nothing predicts token 0
    streamed = []
    body = {"model": model, "prompt": full, "logprobs": 2, "echo": True, "max_tokens": 1}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"]
    assert "".join(c["text"] for c in streamed).startswith(full)
    got = [c["logprobs"] for c in streamed if c["logprobs"]]
    assert got[0]["tokens"][:-1] == lp["tokens"][:-1]  # the prompt's, in the echo's chunk
    assert got[0]["token_logprobs"][1:-1] == pytest.approx(lp["token_logprobs"][1:-1], abs=1e-3)


def _chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(x[6:])["choices"] for x in r.iter_lines() if x.startswith("data: {")]


def test_streamed_logprobs_are_the_tokens_of_each_chunks_text(server):
    """Text held back (a stop string may begin there) keeps its tokens' logprobs with it: the
    streamed offsets and tokens are the whole answer's, and each chunk's tokens make its text."""
    body = {"model": "gemma3-270m", "prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0}
    body |= {"logprobs": 1, "stop": ["8, 9, 10"]}
    whole = _cmpl(server, **body)["logprobs"]
    chunks = [c for cs in _chunks(server, "/v1/completions", body) for c in cs]
    lps = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert sum((lp["text_offset"] for lp in lps), []) == whole["text_offset"]
    assert sum((lp["tokens"] for lp in lps), []) == whole["tokens"]
    for c in chunks[:-1]:
        assert "".join(c["logprobs"]["tokens"] if c["logprobs"] else []) == c["text"]
    chat = {"model": CHAT, "messages": Q, "max_tokens": 12, "temperature": 0, "logprobs": True}
    for cs in _chunks(server, "/v1/chat/completions", {**chat, "stop": ["Paris"]}):
        for c in cs:  # no chunk of logprobs without text
            assert bool(c["logprobs"]) <= bool(c["delta"].get("content")) or c["finish_reason"]


def test_continuous_usage_counts_each_chunks_tokens_so_far(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": CHAT, "messages": Q, "max_tokens": 6, "ignore_eos": True}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": options},
        timeout=120,
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 6 and chunks[-1]["choices"] == []


def test_developer_messages_are_system_messages_and_a_last_message_can_be_continued(server):
    as_system = [{"role": "system", "content": "Answer in French."}, *Q]
    as_developer = [{"role": "developer", "content": "Answer in French."}, *Q]
    a = chat(server, messages=as_system, max_tokens=8)["choices"][0]["message"]["content"]
    b = chat(server, messages=as_developer, max_tokens=8)["choices"][0]["message"]["content"]
    assert a == b
    start = [*Q, {"role": "assistant", "content": "The capital of France is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = post(server, "/tokenize", {"model": CHAT, "messages": start, **fields}).json()
    ends = post(server, "/tokenize", {"model": CHAT, "prompt": " is"}).json()["tokens"]
    assert ids["tokens"][-len(ends) :] == ends  # no end of turn after the open message
    text = chat(server, messages=start, max_tokens=4, **fields)["choices"][0]["message"]
    assert "Paris" in text["content"]


@pytest.mark.parametrize("model", [CHAT, "gemma3-270m"])
def test_logprob_bytes_are_each_tokens_raw_bytes(server, model):
    from prism_server.serving.protocol import token_bytes

    tok = server.engine.model(model).tokenizer
    text = "héllo Paris € 日本"
    ids = tok(text, add_special_tokens=False).input_ids
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert model != CHAT or partial  # SmolLM2 splits a character: decoded text cannot say it


def test_suffix_fills_in_the_middle_where_the_tokenizer_has_the_markers(server):
    import copy

    from prism_server.config import ModelSpec
    from prism_server.served_model import RequestRejected, ServedModel

    r = post(server, "/v1/completions", {"model": CHAT, "prompt": "def f():", "suffix": "end"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"], r.text
    plain = server.engine.served[CHAT]
    tok = copy.deepcopy(plain.tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]}
    )
    fim = ServedModel(ModelSpec("coder", CHAT), tokenizer=tok, vocab_size=len(tok))
    ids = fim.encode_fim("def f():\n    ", "\n    return x")
    pre, suf, mid = tok.convert_tokens_to_ids(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    assert ids[-1] == mid and ids.index(pre) < ids.index(suf) < ids.index(mid)
    assert tok.decode(ids[ids.index(pre) + 1 : ids.index(suf)]) == "def f():\n    "
    assert tok.decode(ids[ids.index(suf) + 1 : -1]) == "\n    return x"
    with pytest.raises(RequestRejected, match="text prompt"):
        fim.encode_fim([1, 2, 3], "x")
