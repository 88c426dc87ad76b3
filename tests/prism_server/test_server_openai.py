"""The server driven by the official `openai` client: chat and completions, stream and not."""

from __future__ import annotations

import openai
import pytest

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_are_listed(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [SMOL, GEMMA]
    assert client.models.retrieve(GEMMA).id == GEMMA


def test_chat_answers_with_real_text(client):
    r = client.chat.completions.create(model=SMOL, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=SMOL, messages=QUESTION, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_completions_stream_and_not(client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and len(whole.choices[0].text) > 0
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == whole.choices[0].text
    if model == GEMMA:  # the 270M base model's greedy continuation
        assert "France" in whole.choices[0].text


def test_completion_prompt_forms(client):
    ids = client.completions.create(
        model=SMOL, prompt="Hello", max_tokens=1, temperature=0
    ).usage.prompt_tokens
    r = client.completions.create(
        model=SMOL, prompt=["One, two,", "Red, green,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    tok = client.completions.create(model=SMOL, prompt=[19556], max_tokens=4, temperature=0)
    assert tok.usage.prompt_tokens == 1 and ids >= 1
    many = client.completions.create(model=SMOL, prompt=[[19556], [504, 3458]], max_tokens=2)
    assert len(many.choices) == 2 and many.usage.prompt_tokens == 3


@pytest.mark.slow
def test_n_seed_stop_and_logprobs(client):
    r = client.chat.completions.create(
        model=SMOL, messages=QUESTION, max_tokens=8, n=3, temperature=1.0, seed=11
    )
    again = client.chat.completions.create(
        model=SMOL, messages=QUESTION, max_tokens=8, n=3, temperature=1.0, seed=11
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    base = (
        client.completions.create(model=GEMMA, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
        .choices[0]
        .text
    )
    stop = base.strip().split(",")[1].strip()  # a number the model writes
    cut = client.completions.create(
        model=GEMMA, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and base.startswith(cut.text)
    lp = client.chat.completions.create(
        model=SMOL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in content)
    clp = (
        client.completions.create(
            model=GEMMA, prompt="Hello", max_tokens=3, logprobs=2, temperature=0
        )
        .choices[0]
        .logprobs
    )
    assert len(clp.tokens) == 3 and len(clp.top_logprobs[0]) == 2


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=GEMMA, messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=SMOL, prompt="hi", max_tokens=100_000)
