"""The OpenAI wire protocol: request models (fields in the order of the OpenAI reference, unknown
fields ignored), their conversion into internal sampling parameters, and the response and error
bodies (whole responses, stream chunks, errors). Nothing else in the server knows the JSON
shapes."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from prism_server import tools
from prism_server.completion import Completion
from prism_server.grammar import GrammarSpec
from scheduler.request import FinishReason, RequestOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 16


class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions requests (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_p: float | None = Field(None, ge=0, le=1)
    # Accepted by OpenAI-shaped clients but not honoured (yet): refused with 400 when set to
    # anything but their no-op value, never dropped in silence. See `check`.
    priority: int = 0
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    guided_json: Any = None  # vLLM's structured-output extensions (a schema, dict or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF
    functions: list[Any] | None = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > 300:
            raise ValueError("at most 300 tokens may be biased")
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        """Field combinations OpenAI refuses (after each field has validated on its own), and
        fields Prism does not honour set to something that would need it."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true.", param="stream_options"
            )
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "prediction": self.prediction is not None,
            "audio": self.audio is not None,
            "modalities": self.modalities not in (None, ["text"]),
            "web_search_options": self.web_search_options is not None,
        }
        for name, used in unsupported.items():
            if used:
                raise APIError(400, f"{name} is not supported by this server.", param=name)
        spec = self.grammar_spec()
        if spec is not None and self.min_tokens:
            raise APIError(
                400, "min_tokens cannot be combined with structured output.", param="min_tokens"
            )

    def grammar_spec(self) -> GrammarSpec | None:
        """The structured output asked for (response_format or one of vLLM's guided_* fields),
        or None; 400 for a malformed one or for more than one."""
        specs = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                specs.append(GrammarSpec("json"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        400,
                        "response_format json_schema needs json_schema.schema, a JSON schema "
                        "object.",
                        param="response_format",
                    )
                strict = js.get("strict")
                specs.append(GrammarSpec("json_schema", json.dumps(schema), strict=bool(strict)))
            elif kind != "text":
                raise APIError(
                    400,
                    f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                    param="response_format",
                )
        if self.guided_json is not None:
            g = self.guided_json
            try:
                text = g if isinstance(g, str) else json.dumps(g)
                if not isinstance(json.loads(text), dict):
                    raise ValueError
            except (TypeError, ValueError):
                raise APIError(
                    400, "guided_json must be a JSON schema object.", param="guided_json"
                ) from None
            specs.append(GrammarSpec("json_schema", text, strict=False, param="guided_json"))
        if self.guided_regex is not None:
            specs.append(GrammarSpec("regex", self.guided_regex, param="guided_regex"))
        if self.guided_choice is not None:
            if not self.guided_choice or any(not c for c in self.guided_choice):
                raise APIError(
                    400, "guided_choice must be non-empty strings.", param="guided_choice"
                )
            specs.append(
                GrammarSpec("choice", choices=tuple(self.guided_choice), param="guided_choice")
            )
        if self.guided_grammar is not None:
            specs.append(GrammarSpec("ebnf", self.guided_grammar, param="guided_grammar"))
        if len(specs) > 1:
            raise APIError(
                400,
                "Only one kind of structured output may be asked for at a time "
                "(response_format, guided_json, guided_regex, guided_choice, guided_grammar).",
                param=specs[1].param,
            )
        return specs[0] if specs else None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, index: int = 0, grammar=None
    ) -> SamplingParams:
        """index: which of the n choices (each gets its own seed when a seed is given);
        grammar: the compiled structured output (see `grammar_spec`)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                seed=seed,
                stop=tuple(self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                min_tokens=min(self.min_tokens, max_tokens),
                logprobs=logprobs,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                repetition_penalty=self.repetition_penalty or 1.0,
                min_p=self.min_p or 0.0,
                logit_bias=tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items()),
                priority=self.priority,
                grammar=grammar,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a function
    parallel_tool_calls: bool | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                400, "top_logprobs is only allowed when logprobs is true.", param="top_logprobs"
            )
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise APIError(400, "Tool function names must be unique.", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise APIError(
                400, "tool_choice is only allowed when tools are specified.", param="tool_choice"
            )
        if choice not in (None, "none", "auto", "required"):
            fn = choice.get("function") if isinstance(choice, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or choice.get("type") != "function":
                raise APIError(
                    400,
                    'tool_choice must be "none", "auto", "required" or '
                    '{"type": "function", "function": {"name": ...}}.',
                    param="tool_choice",
                )
            if name not in names:
                raise APIError(
                    400, f"tool_choice names `{name}`, which is not in tools.", param="tool_choice"
                )
        if self.calls_tools and super().grammar_spec() is not None:
            raise APIError(
                400,
                "Tool calling cannot be combined with response_format or guided decoding.",
                param="tools",
            )
        if self.calls_tools and self.min_tokens:
            raise APIError(
                400, "min_tokens cannot be combined with tool calling.", param="min_tokens"
            )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call the request's tools (they are given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def uses_tools(self) -> bool:
        """Whether the prompt needs a template that knows tools (tools, or calls in the history)."""
        return bool(self.tools) or any(m.role == "tool" or m.tool_calls for m in self.messages)

    def tool_defs(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (None when the model may not call them)."""
        if not self.calls_tools:
            return None
        return [
            {"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in self.tools
        ]

    def grammar_spec(
        self, tool_format: str | None = None, thinks: bool = False
    ) -> GrammarSpec | None:
        """The structured output, or with tools the grammar of the model's tool-call format
        (`tool_format`) for tool_choice auto, required or the named function; thinks: the model
        may open with a <think> block (Qwen3), which the grammar then allows."""
        if not self.calls_tools or tool_format is None:
            return super().grammar_spec()
        choice = self.tool_choice or "auto"
        tools = [{"type": "function", "function": t.function.model_dump()} for t in self.tools]
        for t in tools:
            t["function"]["parameters"] = t["function"]["parameters"] or {"type": "object"}
        spec = {
            "format": tool_format,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "reasoning": "auto" if thinks else "disabled",
        }
        return GrammarSpec("tools", json.dumps(spec), param="tools")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: text content; an assistant's tool calls
        with their arguments as objects; a tool result with its call's id."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            try:
                msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            except ValueError as e:
                raise APIError(400, str(e), param=f"messages.{i}.content") from None
            if m.tool_calls:
                if m.role != "assistant":
                    raise APIError(
                        400, "Only assistant messages carry tool_calls.", param=f"messages.{i}"
                    )
                msg["tool_calls"] = [
                    _history_call(c, f"messages.{i}.tool_calls.{j}")
                    for j, c in enumerate(m.tool_calls)
                ]
            if m.role == "tool":
                if not m.tool_call_id:
                    raise APIError(
                        400,
                        "A tool message needs the tool_call_id it answers.",
                        param=f"messages.{i}.tool_call_id",
                    )
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


def _history_call(call: Any, param: str) -> dict[str, Any]:
    """An assistant's earlier tool call, its arguments (JSON text on the wire) as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "A tool call needs function.name.", param=param)
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise APIError(
                400, "A tool call's arguments must be JSON text.", param=f"{param}.function"
            ) from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400,
                "best_of is only supported equal to n (each choice is returned).",
                param="best_of",
            )

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int = 0, grammar=None):
        """With echo and logprobs, the prompt's logprobs too."""
        p = super().sampling_params(max_tokens, logprobs, index, grammar)
        if self.echo and logprobs is not None:
            p = dataclasses.replace(p, prompt_logprobs=logprobs)
        return p

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: the tools the template describes
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "Give either prompt or messages.", param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int]

    def check(self) -> None:
        pass


# ---- responses ---------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """cached_tokens: prompt tokens the prefix cache held (per prompt, summed)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "abort" if reason in (FinishReason.ABORT, FinishReason.ERROR) else reason.value


class LogprobFormatter:
    """Token logprobs in chat form ({"content": [...]}) or completions form (parallel lists)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _tok(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = self._tok(tid)
            return {"token": s, "logprob": lp, "bytes": list(token_bytes(self.tokenizer, tid))}

        return {
            "content": [
                {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                for x in lps
            ]
        }

    def completion(
        self, lps: list[TokenLogprob | int], text_offset: int, then: dict | None = None
    ) -> dict[str, Any]:
        """An int in lps is a token without a logprob (a prompt's first: nothing predicts it).
        then: logprobs in this form to append (a prompt's, then its completion's)."""
        tokens, offsets = [], []
        for x in lps:
            offsets.append(text_offset)
            s = self._tok(x if isinstance(x, int) else x.token_id)
            tokens.append(s)
            text_offset += len(s)
        out = {
            "tokens": tokens,
            "token_logprobs": [None if isinstance(x, int) else x.logprob for x in lps],
            "top_logprobs": [
                None if isinstance(x, int) else {self._tok(t): v for t, v in x.top} for x in lps
            ],
            "text_offset": offsets,
        }
        for key, values in (then or {}).items():
            out[key] += values
        return out


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: printable bytes stand for themselves, the other 68 for
    chr(256 + k) in byte order (the byte-level BPE convention)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    extra = (b for b in range(256) if b not in set(keep))
    table.update({chr(256 + k): b for k, b in enumerate(extra)})
    return table


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for, also when it holds part of a UTF-8 character (its decoded
    text then has a replacement character): byte-level BPE pieces map back through GPT-2's byte
    alphabet, SentencePiece byte-fallback pieces (<0xE2>) are one byte, '▁' is a space."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif "\u2581" in piece or type(decoder).__name__ in ("Sequence", "Metaspace"):
            return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id]).encode()


def stream_error(message: str) -> dict:
    """The event sent in place of a chunk when generation fails after the stream started."""
    return error_body(message, "server_error")


class _Shapes:
    """The JSON of one response (chat or completions): chunks, first and delta choices, the
    whole non-streaming body. `choices` are (index, Completion) pairs."""

    object: str
    chunk_object: str

    def __init__(self, rid: str, model: str, fmt: LogprobFormatter, logprobs: bool):
        self.rid, self.model, self.fmt, self.logprobs = rid, model, fmt, logprobs
        self.created = now()

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {
            "id": self.rid,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def response(self, choices: list[tuple[int, Completion]], prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": self.object,
            "created": now(),
            "model": self.model,
            "choices": [self.whole(i, c) for i, c in choices],
            "usage": self.usage(prompt_tokens, choices),
        }

    def prompt_of(self, index: int) -> int:
        """Which prompt a choice answers (chat: the one)."""
        return 0

    def usage(self, prompt_tokens: int, choices: list[tuple[int, Completion]]) -> dict[str, Any]:
        """The usage of the whole response; a prompt's cached tokens are the most any of its
        choices found."""
        cached: dict[int, int] = {}
        for i, c in choices:
            p = self.prompt_of(i)
            cached[p] = max(cached.get(p, 0), c.num_cached_tokens)
        generated = sum(len(c.token_ids) for _, c in choices)
        return usage(prompt_tokens, generated, sum(cached.values()))

    def first(self, indices: list[int]) -> list[dict]:
        """Choices sent before any output (may be none)."""
        return []

    def delta(self, index: int, c: Completion, out: RequestOutput) -> dict | None:
        """The choice's delta for `out` (already folded into `c`); None: nothing to send yet."""

    def whole(self, index: int, c: Completion) -> dict: ...


class ChatShapes(_Shapes):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(
        self,
        rid: str,
        model: str,
        fmt: LogprobFormatter,
        logprobs: bool,
        tool_format: str | None = None,
        parallel_tool_calls: bool = True,
    ):
        """tool_format: the model's tool-call format when the request lets it call tools (its
        output is parsed into tool calls), else None."""
        super().__init__(rid, model, fmt, logprobs)
        self.tool_format, self.parallel = tool_format, parallel_tool_calls
        self._streams: dict[int, tools.ToolCallStream] = {}

    def first(self, indices: list[int]) -> list[dict]:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in indices
        ]

    def delta(self, index: int, c: Completion, out: RequestOutput) -> dict | None:
        lp = self.fmt.chat(out.logprobs) if self.logprobs and out.logprobs else None
        delta: dict[str, Any] = {"content": out.new_text} if out.new_text else {}
        called = False
        if self.tool_format is not None:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = tools.ToolCallStream(
                    self.tool_format, self.parallel
                )
            d = stream.feed(c.text, out.finished)
            delta = {"content": d.content} if d.content else {}
            if d.calls:
                delta["tool_calls"] = d.calls
            called = stream.called
            if not (delta or lp or out.finished):
                return None  # held back: what came may start a call
        return {
            "index": index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": _chat_finish(out.finish_reason, called) if out.finished else None,
        }

    def whole(self, index: int, c: Completion) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        calls: list[dict] = []
        if self.tool_format is not None:
            p = tools.parse(c.text, self.tool_format, final=True, parallel=self.parallel)
            calls = [
                {
                    "id": tools.new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in p.calls
                if call.name is not None
            ]
            message = {"role": "assistant", "content": p.content or None}
            if calls:
                message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": self.fmt.chat(c.logprobs) if self.logprobs else None,
            "finish_reason": _chat_finish(c.finish_reason, bool(calls)),
        }


def _chat_finish(reason: FinishReason | None, called: bool) -> str | None:
    """A chat choice's finish_reason: "tool_calls" when it ended by calling tools."""
    if called and reason is FinishReason.STOP:
        return "tool_calls"
    return finish_reason(reason)


class CompletionShapes(_Shapes):
    object = chunk_object = "text_completion"

    def __init__(
        self,
        rid: str,
        model: str,
        fmt: LogprobFormatter,
        logprobs: bool,
        echo: list[str],
        n: int,
        bos_added: list[bool] | None = None,
    ):
        """echo: per prompt (choice index // n), the text echoed ("" without echo); bos_added:
        per prompt, whether tokenizing added a BOS (not echoed, so not in the logprobs)."""
        super().__init__(rid, model, fmt, logprobs)
        self.echo, self.n = echo, n
        self.bos_added = bos_added or [False] * len(echo)
        self._echoed: set[int] = set()  # streamed choices whose echo went out

    def prompt_of(self, index: int) -> int:
        return index // self.n

    def first(self, indices: list[int]) -> list[dict]:
        if self.logprobs:  # the echo goes out with the prompt's logprobs, in the first delta
            return []
        self._echoed.update(indices)
        return [
            {"index": i, "text": self.echo[i // self.n], "logprobs": None, "finish_reason": None}
            for i in indices
            if self.echo[i // self.n]
        ]

    def _logprobs(self, index: int, c: Completion, lps: list[TokenLogprob], offset: int):
        """The completions logprobs of `lps` at text `offset`, after the prompt's (with echo)."""
        p = index // self.n
        if not self.echo[p] or index in self._echoed:
            return self.fmt.completion(lps, offset)
        prompt: list[TokenLogprob | int] = list(c.prompt_logprobs or [])
        if not self.bos_added[p]:  # the prompt's first token: nothing predicts it
            prompt.insert(0, c.prompt_token_ids[0])
        tail = self.fmt.completion(lps, offset)
        return self.fmt.completion(prompt, 0, tail)

    def delta(self, index: int, c: Completion, out: RequestOutput) -> dict:
        echo = "" if index in self._echoed else self.echo[index // self.n]
        lp = None
        if self.logprobs and (out.logprobs or echo):
            offset = len(self.echo[index // self.n]) + len(c.text) - len(out.new_text)
            lp = self._logprobs(index, c, out.logprobs or [], offset)
        self._echoed.add(index)
        return {
            "index": index,
            "text": echo + out.new_text,
            "logprobs": lp,
            "finish_reason": finish_reason(out.finish_reason) if out.finished else None,
        }

    def whole(self, index: int, c: Completion) -> dict:
        echo = self.echo[index // self.n]
        lp = self._logprobs(index, c, c.logprobs, len(echo)) if self.logprobs else None
        return {
            "index": index,
            "text": echo + c.text,
            "logprobs": lp,
            "finish_reason": finish_reason(c.finish_reason),
        }


def model_card(name: str, created: int, **extra: Any) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "prism", **extra}


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatShapes",
    "CompletionRequest",
    "CompletionShapes",
    "LogprobFormatter",
    "RequestOutput",
    "error_body",
    "finish_reason",
    "model_card",
    "stream_error",
    "usage",
    "validation_error",
]
