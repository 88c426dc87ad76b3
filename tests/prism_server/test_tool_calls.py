"""Tool calling: tools and tool_choice (auto, required, a named function, none) through the chat
template (a Hermes ChatML template for SmolLM2, whose own has no tools), enforced by the grammar
of the model's tool-call format and parsed into OpenAI tool calls, whole or streamed; through the
official openai client and LangChain too. The parser and the format detection are tested on
their own; malformed tools, choices and histories get 400 with the envelope."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from models.loader import ModelSource, model_dir
from models.tokenizer import load_tokenizer
from prism_server import envs, tools
from prism_server.config import ModelSpec
from prism_server.served_model import RequestRejected, ServedModel

CHAT = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time in a city", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
Q = [{"role": "user", "content": "What is the weather like in Paris?"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(server, **fields) -> httpx.Response:
    body = {"model": CHAT, "messages": Q, "max_tokens": 60, "temperature": 0, **fields}
    return post(server, "/v1/chat/completions", body)


def streamed(server, **fields) -> tuple[list[dict], list[dict]]:
    """(the chunks' choices, every tool-call delta in order)."""
    body = {"model": CHAT, "messages": Q, "max_tokens": 60, "temperature": 0, **fields}
    body["stream"] = True
    choices = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[6:])["choices"]
    deltas = [d for c in choices for d in c["delta"].get("tool_calls", [])]
    return choices, deltas


def folded(deltas: list[dict]) -> list[dict]:
    """Stream deltas folded the way the openai client does: by index."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"name": None, "arguments": ""})
        if "id" in d:
            assert d["type"] == "function" and c["name"] is None, d
            c["id"], c["name"] = d["id"], d["function"]["name"]
        c["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# ---- the parser and the format detection -------------------------------------------------------
HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"a": "}"}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_output_parses_into_content_and_calls_whole_or_char_by_char():
    p = tools.parse(HERMES, "qwen_3", final=True)
    assert p.content == "Let me check."
    assert [(c.name, json.loads(c.arguments), c.done) for c in p.calls] == [
        ("get_weather", {"city": 'Pa"ris', "n": [1, {"a": "}"}]}, True),
        ("get_time", {}, True),
    ]
    s = tools.ToolCallStream("qwen_3")
    steps = [s.feed(HERMES[:k], k == len(HERMES)) for k in range(1, len(HERMES) + 1)]
    assert "".join(d.content for d in steps) == p.content
    calls = folded([c for d in steps for c in d.calls])
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in p.calls]
    assert tools.parse(HERMES, "qwen_3", final=True, parallel=False).calls == p.calls[:1]


def test_a_partial_marker_is_held_back_while_streaming_and_is_text_at_the_end():
    assert tools.parse("Hi <tool_c", "qwen_3", final=False).content == "Hi"
    assert tools.parse("Hi <tool_c", "qwen_3", final=True).content == "Hi <tool_c"
    assert tools.parse("Hi <b>", "qwen_3", final=False).content == "Hi <b>"
    cut = tools.parse('<tool_call>\n{"name": "f", "arguments": {"x": 12', "qwen_3", final=True)
    assert cut.content == "" and cut.calls == [tools.ParsedCall("f", '{"x": 12', False)]
    unnamed = tools.parse('<tool_call>\n{"name": "get_w', "qwen_3", final=False)
    assert unnamed.calls == [tools.ParsedCall(None, "", False)]


def test_llama_json_calls_parse():
    text = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [2]}}'
    p = tools.parse(text, "llama", final=True)
    assert p.content == "" and [(c.name, c.arguments) for c in p.calls] == [
        ("f", '{"x": 1}'),
        ("g", '{"y": [2]}'),
    ]


def test_the_tool_format_follows_the_chat_template():
    assert tools.tool_format("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}") == (
        "qwen_3",
        tools.CHATML_TOOLS_TEMPLATE,
    )
    qwen = "{% if tools %}<tools>{{ tools }}</tools><tool_call>{% endif %}<|im_start|>"
    assert tools.tool_format(qwen) == ("qwen_3", None)
    llama = '{% if tools %}{"name": function name, "parameters": ...}<|python_tag|>{% endif %}'
    assert tools.tool_format(llama) == ("llama", None)
    assert tools.tool_format("<start_of_turn>{{ messages }}") is None
    assert tools.tool_format("{% if tools %}[TOOL_CALLS]{% endif %}") is None
    assert tools.tool_format(None) is None


def test_a_template_without_tools_refuses_them():
    tok = load_tokenizer(model_dir(ModelSource.parse(CHAT), envs.gguf_cache_dir()))
    tok.chat_template = "{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}"
    served = ServedModel(ModelSpec(CHAT, CHAT), tokenizer=tok)
    assert served.tool_format is None
    with pytest.raises(RequestRejected) as e:
        served.encode_chat(Q, tool_defs=TOOLS, with_tools=True)
    assert e.value.param == "tools" and "tool-calling" in str(e.value)
    assert served.encode_chat(Q)  # without tools it still serves


def test_template_arguments_reach_the_template():
    """chat_template_kwargs are the template's variables (Qwen3's enable_thinking is one);
    continue_final_message leaves the last message open instead of starting a new turn."""
    tok = load_tokenizer(model_dir(ModelSource.parse(CHAT), envs.gguf_cache_dir()))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% if think %}<think>{% endif %}{% endif %}"
    )
    served = ServedModel(ModelSpec(CHAT, CHAT), tokenizer=tok)
    text = lambda ids: tok.decode(ids)  # noqa: E731
    assert text(served.encode_chat(Q)).endswith("<|im_end|><|im_start|>")
    assert text(served.encode_chat(Q, template_kwargs={"think": True})).endswith("<think>")
    more = [*Q, {"role": "assistant", "content": "The capital is"}]
    ids = served.encode_chat(more, add_generation_prompt=False, continue_final_message=True)
    assert text(ids).endswith("The capital is")


# ---- over HTTP ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_required_returns_a_call_whose_arguments_validate_streamed_or_not(server):
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    r = chat(server, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    name, args = call["function"]["name"], call["function"]["arguments"]
    jsonschema.validate(json.loads(args), SCHEMAS[name])
    chunks, deltas = streamed(server, **fields)
    assert deltas[0]["function"]["name"] == name and "id" in deltas[0]
    assert [(c["name"], c["arguments"]) for c in folded(deltas)] == [(name, args)]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert all("content" not in c["delta"] or c["delta"]["content"] == "" for c in chunks)


@pytest.mark.slow
def test_a_named_function_is_the_one_called(server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(server, tools=TOOLS, tool_choice=choice)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TIME)


@pytest.mark.slow
def test_parallel_calls_each_validate(server):
    r = chat(server, tools=TOOLS, tool_choice="required", max_tokens=120)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls
    for c in calls:
        if r.json()["choices"][0]["finish_reason"] == "length" and c is calls[-1]:
            continue  # cut short by max_tokens
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.slow
def test_auto_and_none_answer_in_text_and_the_prompt_carries_the_tools_only_for_auto(server):
    r = chat(server, tools=TOOLS)  # tool_choice defaults to auto; this model answers in prose
    msg = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and msg["content"] and "tool_calls" not in msg, msg
    assert "<tool_call>" not in msg["content"]
    with_tools = r.json()["usage"]["prompt_tokens"]
    r = chat(server, tools=TOOLS, tool_choice="none")
    assert r.json()["usage"]["prompt_tokens"] < with_tools
    assert "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.slow
def test_tool_results_in_the_history_reach_the_template(server):
    history = [
        *Q,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = post(server, "/tokenize", {"model": CHAT, "messages": history, "tools": TOOLS})
    text = post(server, "/detokenize", {"model": CHAT, "tokens": r.json()["tokens"]}).json()
    prompt = text["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools, described in the system turn
    r = chat(server, messages=history, tools=TOOLS, max_tokens=20)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_the_openai_client_and_langchain_get_tool_calls(server):
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=CHAT, messages=Q, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    call = r.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    llm = ChatOpenAI(
        model=CHAT, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=60
    )
    bound = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    out = bound.invoke(Q[0]["content"])
    assert isinstance(out, AIMessage) and len(out.tool_calls) == 1, out
    jsonschema.validate(out.tool_calls[0]["args"], SCHEMAS[out.tool_calls[0]["name"]])
    streamed_out = None
    for chunk in bound.stream(Q[0]["content"]):
        streamed_out = chunk if streamed_out is None else streamed_out + chunk
    assert [(c["name"], c["args"]) for c in streamed_out.tool_calls] == [
        (c["name"], c["args"]) for c in out.tool_calls
    ]
    schema = {"title": "weather", "description": "the weather query", **WEATHER}
    obj = llm.with_structured_output(schema, method="function_calling").invoke(Q[0]["content"])
    jsonschema.validate(obj, WEATHER)


BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, None),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, None),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, None),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"tools": TOOLS, "min_tokens": 2}, "min_tokens"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools",
        ),
        ({"messages": [*Q, {"role": "tool", "content": "4"}]}, "messages.1.tool_call_id"),
        ({"messages": [*Q, {"role": "assistant", "tool_calls": [BAD_CALL]}]}, None),
        ({"messages": [*Q, {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, None),
    ],
)
def test_malformed_tools_choices_and_histories_get_400(server, fields, param):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    else:
        assert err["param"] and err["param"].split(".")[0] in ("tools", "tool_choice", "messages")


def test_a_model_without_a_chat_template_refuses_tools(server):
    body = {"model": "gemma3-270m", "messages": Q, "tools": TOOLS, "max_tokens": 4}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


@pytest.mark.slow
def test_litellm_gets_tool_calls(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    import litellm

    r = litellm.completion(
        model=f"openai/{CHAT}",
        api_base=server.url + "/v1",
        api_key="none",
        messages=Q,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert r.choices[0].finish_reason == "tool_calls"


def test_a_thinking_model_may_think_before_it_calls():
    """Qwen3's template opens answers with <think>: the tool grammar then allows a think block
    first (and none for other models); both compile against a real tokenizer."""
    from prism_server.grammar import Grammars
    from prism_server.serving.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(model=CHAT, messages=Q, tools=TOOLS, tool_choice="required")
    plain, thinking = req.grammar_spec("qwen_3"), req.grammar_spec("qwen_3", thinks=True)
    assert json.loads(plain.source)["reasoning"] == "disabled"
    assert json.loads(thinking.source)["reasoning"] == "auto"
    tok = load_tokenizer(model_dir(ModelSource.parse(CHAT), envs.gguf_cache_dir()))
    g = Grammars(tok, len(tok), [tok.eos_token_id])
    assert g.compile(plain) is not None and g.compile(thinking) is not None
