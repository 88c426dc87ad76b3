"""Chat's request models: messages, tools, /v1/chat/completions and vLLM's /tokenize of
messages through the chat template. Messages and tools keep fields they do not use: a client
sends back the assistant messages it was given, with their extra fields."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prism_server.grammar import GrammarSpec
from prism_server.serving.protocol.requests import Body, SamplingFields
from prism_server.serving.protocol.responses import APIError

# messages and tools: types as strict as a body's; fields they do not use are ignored (a client
# sends back the assistant messages it was given, with their extra fields)
_KEEPS_EXTRA = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ContentPart(BaseModel):
    model_config = _KEEPS_EXTRA
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _KEEPS_EXTRA
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
    model_config = _KEEPS_EXTRA
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    model_config = _KEEPS_EXTRA
    type: Literal["function"]
    function: FunctionDef


# apply_chat_template's own arguments, which chat_template_kwargs may not pass again
_TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


class ChatCompletionRequest(SamplingFields):
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


class TokenizeRequest(Body):
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
