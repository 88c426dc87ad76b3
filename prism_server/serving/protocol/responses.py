"""OpenAI response bodies: the error envelope, whole responses and stream chunks of chat and
completions (`ChatShapes`, `CompletionShapes`), usage, logprobs and model cards."""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from pydantic import ValidationError

from prism_server import tools
from prism_server.completion import Completion
from scheduler.request import FinishReason, RequestOutput, TokenLogprob


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
    """A request body's first invalid field as a 400: its path (`messages.0.content`) as the
    param; where the field may take several types, what it takes."""
    errors = e.errors()
    err = errors[0]
    path, tags = _field_path(err["loc"]), []
    for x in errors:  # a union's members, each a failed try at the same field
        loc = x["loc"]
        if len(loc) > len(path) and _field_path(loc) == path and loc[len(path)] not in tags:
            tags.append(loc[len(path)])
    param = ".".join(map(str, path)) or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if tags:
        names = [_TYPE_NAMES.get(t, str(t)) for t in tags]
        alternatives = ", ".join(names[:-1]) + " or " if len(names) > 1 else ""
        msg = f"Input should be {alternatives}{names[-1]}"
    else:
        msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


_TYPE_NAMES = {
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids",
    "list[list[int]]": "a list of token-id lists",
    "list[ContentPart]": "a list of content parts",
    "dict[str,any]": "an object",
    "dict": "an object",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
}


def _field_path(loc: tuple) -> tuple:
    """loc up to its first union member's tag (pydantic names the member it tried: `str`,
    `list[int]`, `function-after[...]`): the field's own path."""
    for i, p in enumerate(loc):
        if isinstance(p, str) and (p in _TYPE_NAMES or not p.isidentifier() or p[0].isupper()):
            return loc[:i]
    return tuple(loc)


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
    """Token logprobs in chat form ({"content": [...]}) or completions form (parallel lists).
    skip_special: the text leaves special tokens out (the request's skip_special_tokens), so
    their text_offset takes no room."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self._no_text = set(getattr(tokenizer, "all_special_ids", ())) if skip_special else set()

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

    def text_length(self, lps: list[TokenLogprob]) -> int:
        """The characters these tokens take in the text, as `completion` counts them."""
        return sum(0 if x.token_id in self._no_text else len(self._tok(x.token_id)) for x in lps)

    def completion(
        self, lps: list[TokenLogprob | int], text_offset: int, then: dict | None = None
    ) -> dict[str, Any]:
        """An int in lps is a token without a logprob (a prompt's first: nothing predicts it).
        then: logprobs in this form to append (a prompt's, then its completion's)."""
        tokens, offsets = [], []
        for x in lps:
            offsets.append(text_offset)
            tid = x if isinstance(x, int) else x.token_id
            s = self._tok(tid)
            tokens.append(s)
            text_offset += 0 if tid in self._no_text else len(s)
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
        self._offset: dict[int, int] = {}  # a streamed choice's next token's text_offset

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
            # the offsets as `whole` gives them: each token's text after the one before
            lps = out.logprobs or []
            offset = self._offset.get(index, len(self.echo[index // self.n]))
            lp = self._logprobs(index, c, lps, offset)
            self._offset[index] = offset + self.fmt.text_length(lps)
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
