"""Tool calling: which tool-call format a model's chat template speaks, a template for ChatML
models whose own has no tools (the Hermes form Qwen uses), and the parser that turns generated
text into OpenAI tool calls, whole or as stream deltas.

Two formats (the names are xgrammar's, which builds the grammar that enforces them):
- "qwen_3" (Hermes): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, repeated
  for parallel calls; text before the first call is the message's content.
- "llama" (Llama 3.1+ JSON): `{"name": "f", "parameters": {...}}`, repeated.
The sampler's grammar keeps calls well formed (arguments valid against the function's schema);
the parser is still total: a call cut short by max_tokens comes back with the arguments so far.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

# the marker each format starts a call with, and the key holding its arguments
FORMATS = {
    "qwen_3": ("<tool_call>", "arguments"),
    "llama": ('{"name"', "parameters"),
}

# A ChatML template with tools, in the Hermes form Qwen2.5 was trained on: for ChatML models whose
# own template has no tools (SmolLM2). Tools go into the system message, calls into <tool_call>
# tags, tool results back as <tool_response> in a user turn.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def tool_format(template: str | None) -> tuple[str, str | None] | None:
    """(format, template to use instead of the model's own, or None) for a chat template, or
    None when Prism cannot call tools through it."""
    if not template:
        return None
    if "tools" in template:
        if "<tool_call>" in template:
            return "qwen_3", None
        if "<|python_tag|>" in template or '"parameters"' in template:
            return "llama", None
        return None
    if "<|im_start|>" in template:
        return "qwen_3", CHATML_TOOLS_TEMPLATE
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- parsing -----------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str | None  # None until its name has been generated in full
    arguments: str  # the raw JSON text so far (complete once `done`)
    done: bool


@dataclass
class Parsed:
    content: str  # the text before the first call (what may be shown so far, when streaming)
    calls: list[ParsedCall]


_WS = " \t\r\n"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, or None if the string is not closed."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i], or None if it is not complete yet."""
    if i >= len(s):
        return None
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i  # a number or a literal: complete at the next delimiter
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def _scan_call(s: str, i: int, args_key: str) -> tuple[ParsedCall, int | None]:
    """The call object starting at s[i] ('{'): its name, raw arguments and whether it is
    complete; and the index after it (None while incomplete)."""
    name, args, args_done = None, "", False
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return ParsedCall(name, args, False), None
        if s[i] == "}":
            return ParsedCall(name, args, args_done), i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            return ParsedCall(name, args, False), None  # not JSON: give up on this call
        key_end = _string_end(s, i)
        if key_end is None:
            return ParsedCall(name, args, False), None
        key = s[i + 1 : key_end - 1]
        i = _skip_ws(s, key_end)
        if i >= len(s) or s[i] != ":":
            return ParsedCall(name, args, False), None
        i = _skip_ws(s, i + 1)
        end = _value_end(s, i)
        if key == "name":
            if end is not None and s[i] == '"':
                name = json.loads(s[i:end])
        elif key == args_key:
            args, args_done = s[i : end if end is not None else len(s)], end is not None
        if end is None:
            return ParsedCall(name, args, False), None
        i = end


def parse(text: str, fmt: str, final: bool, parallel: bool = True) -> Parsed:
    """The content and the tool calls in `text` so far. final: the text is complete (a marker
    cut short at the end is content then; while streaming it is held back, as is whitespace
    that may precede a call)."""
    marker, args_key = FORMATS[fmt]
    start = text.find(marker)
    if start < 0:
        content = text
        if not final:  # hold back what may be the start of a marker, and trailing whitespace
            for k in range(min(len(marker) - 1, len(content)), 0, -1):
                if marker.startswith(content[-k:]):
                    content = content[:-k]
                    break
            content = content.rstrip(_WS)
        return Parsed(content, [])
    calls: list[ParsedCall] = []
    pos = start
    while pos >= 0 and (parallel or not calls):
        obj = pos if fmt == "llama" else text.find("{", pos + len(marker))
        if obj < 0:
            break
        call, end = _scan_call(text, obj, args_key)
        calls.append(call)
        if end is None:
            break
        pos = text.find(marker, end)
    return Parsed(text[:start].rstrip(_WS), calls)


@dataclass
class ToolDeltas:
    """What one stream step adds: content text, and per call index its header (id and name, sent
    once) and arguments text."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)


class ToolCallStream:
    """One choice's tool-call parser while it streams: each `feed` of the whole text so far
    returns only what is new, in OpenAI's delta shape."""

    def __init__(self, fmt: str, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self._content = 0  # characters of content sent
        self._args: list[int] = []  # per call announced: characters of arguments sent

    def feed(self, text: str, final: bool) -> ToolDeltas:
        p = parse(text, self.fmt, final, self.parallel)
        out = ToolDeltas(content=p.content[self._content :])
        self._content = len(p.content)
        for i, call in enumerate(p.calls):
            if i >= len(self._args):
                if call.name is None:
                    break  # announced once its name is whole, with the arguments so far
                self._args.append(len(call.arguments))
                fn = {"name": call.name, "arguments": call.arguments}
                out.calls.append(
                    {"index": i, "id": new_call_id(), "type": "function", "function": fn}
                )
                continue
            new = call.arguments[self._args[i] :]
            if new:
                self._args[i] = len(call.arguments)
                out.calls.append({"index": i, "function": {"arguments": new}})
        return out

    @property
    def called(self) -> bool:
        return bool(self._args)
