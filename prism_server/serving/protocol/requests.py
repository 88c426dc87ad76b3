"""OpenAI request models: fields in the order of the OpenAI reference, then vLLM's extensions;
the field combinations OpenAI refuses, and the conversion into internal sampling parameters.

A body is read as OpenAI reads it: a null field is its default, a value of the wrong JSON type
is refused (no "2" for 2), and so is a field this server does not know (OpenAI's
"Unrecognized request argument"). Fields it knows but does not honour are refused when set to
anything but their no-op value (`check`). Messages and tools keep fields they do not use: a
client sends back the assistant messages it was given, with their extra fields."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prism_server.grammar import GrammarSpec
from prism_server.serving.protocol.responses import APIError
from scheduler.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 16
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
# apply_chat_template's own arguments, which chat_template_kwargs may not pass again
_TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


class _Body(BaseModel):
    """A request body's top level: unknown fields refused, a null field is its default."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: bool = False  # OpenAI's padding of chunks: not sent


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported")
            if part.text is None:
                raise ValueError("a content part of type 'text' needs its text")
        return "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    type: Literal["function"]
    function: FunctionDef


class _SamplingFields(_Body):
    """Fields shared by chat and completions requests (OpenAI's, then vLLM's extensions)."""

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
    safety_identifier: str | None = None  # like user: for the provider's abuse monitoring
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache needs none
    store: bool = False  # refused when true (nothing is stored), and so is metadata
    metadata: dict[str, str] | None = None
    service_tier: str | None = None  # auto and default: the one tier
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
    use_beam_search: bool = False
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

    @property
    def continuous_usage(self) -> bool:
        """The usage so far in every chunk (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check(self) -> None:
        """Field combinations OpenAI refuses (after each field has validated on its own), and
        fields Prism does not honour set to something that would need it."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true.", param="stream_options"
            )
        unsupported = {
            "store": self.store,
            "metadata": bool(self.metadata),
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "use_beam_search": self.use_beam_search,
            "stream_options.include_obfuscation": bool(
                self.stream_options and self.stream_options.include_obfuscation
            ),
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
            extra = _unknown_format_field(rf)
            if extra is not None and kind in ("text", "json_object", "json_schema"):
                raise APIError(
                    400,
                    f"response_format of type {kind} takes no field `{extra}`.",
                    param="response_format",
                )
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


def _unknown_format_field(rf: dict[str, Any]) -> str | None:
    """The first field of response_format that its type does not take (json_schema.x: one
    inside json_schema), or None."""
    kind = rf.get("type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    js = rf.get("json_schema")
    inner = js if kind == "json_schema" and isinstance(js, dict) else {}
    return next(
        (k for k in rf if k not in allowed),
        next((f"json_schema.{k}" for k in inner if k not in _JSON_SCHEMA_KEYS), None),
    )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a function
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # refused: for OpenAI's reasoning models
    verbosity: str | None = None  # refused likewise
    # vLLM's chat extensions
    echo: bool = False  # refused when true
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message continued
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def length_fields(self) -> tuple[str, str]:
        """The names of the prompt and of the output's bound, as this request sent them."""
        return "messages", "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def check(self) -> None:
        super().check()
        for name in ("reasoning_effort", "verbosity", "echo"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server.", param=name)
        if self.continue_final_message and (
            self.add_generation_prompt or self.messages[-1].role != "assistant"
        ):
            raise APIError(
                400,
                "continue_final_message continues a last assistant message, with "
                "add_generation_prompt false.",
                param="continue_final_message",
            )
        taken = sorted((self.chat_template_kwargs or {}).keys() & _TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(
                400,
                f"chat_template_kwargs may not set `{taken[0]}`, an argument of the template "
                "call itself.",
                param="chat_template_kwargs",
            )
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
            role = "system" if m.role == "developer" else m.role  # OpenAI's new name for it
            try:
                msg: dict[str, Any] = {"role": role, "content": m.text()}
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

    @property
    def length_fields(self) -> tuple[str, str]:
        return "prompt", "max_tokens"

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


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: the tools the template describes
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "Give either prompt or messages.", param="prompt")

    def chat(self) -> ChatCompletionRequest:
        """The messages as a chat request's (the same template arguments, checked alike)."""
        fields = ("messages", "tools", "add_generation_prompt", "continue_final_message")
        chat = ChatCompletionRequest.model_construct(
            model=self.model,
            chat_template_kwargs=self.chat_template_kwargs,
            **{f: getattr(self, f) for f in fields},
        )
        chat.check()
        return chat


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int]

    def check(self) -> None:
        pass
