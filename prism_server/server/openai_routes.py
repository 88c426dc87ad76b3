"""OpenAI routes. Each handler: validate -> convert -> stream or not."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import ValidationError

from prism_server.engine import ModelFailed, ModelNotFound
from prism_server.model_engine import ContextLengthExceeded, ModelEngine
from prism_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LogprobFormatter,
    chat_chunk,
    completion_chunk,
    finish_reason,
    model_card,
    now,
    usage,
    validation_error,
)
from prism_server.request import RequestOutput
from prism_server.server.async_engine import AsyncEngine, RequestStream
from prism_server.server.sse import SSEWriter


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except web.HTTPRequestEntityTooLarge:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return body


@dataclass
class Choice:
    """One output choice being assembled (index in the response, its request stream)."""

    index: int
    prompt_ids: list[int]
    stream: RequestStream
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or []
        if out.finished:
            self.finish_reason = finish_reason(out.finish_reason)
            self.error = out.error


class OpenAIRoutes:
    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine
        self.engine = aengine.engine
        self.created = now()

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id:.+}", self.get_model)

    # ---- models ---------------------------------------------------------------------------------
    def _card(self, name: str) -> dict:
        if name in self.engine.failed:
            return model_card(name, self.created, status="failed", error=self.engine.failed[name])
        me = self.engine.models[name]
        return model_card(name, self.created, max_model_len=me.max_model_len, status="resident")

    def _names(self) -> list[str]:
        """Every configured model, in config order (failed ones included)."""
        return [
            m.name
            for m in self.engine.config.models
            if m.name in self.engine.models or m.name in self.engine.failed
        ]

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(n) for n in self._names()]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._names():
            raise _not_found(name)
        return web.json_response(self._card(name))

    # ---- shared -------------------------------------------------------------------------------
    def _model(self, name: str) -> ModelEngine:
        try:
            return self.engine.model(name)
        except ModelNotFound:
            raise _not_found(name) from None
        except ModelFailed as e:
            raise APIError(
                503, str(e), "server_error", param="model", code="model_load_failed"
            ) from None

    async def _parse(self, request: web.Request, cls):
        """The validated request body and the model it names."""
        try:
            req = cls.model_validate(await read_json(request))
        except ValidationError as e:
            raise validation_error(e) from None
        return req, self._model(req.model)

    def _max_tokens(self, me: ModelEngine, requested: int | None, prompt_len: int) -> int:
        if prompt_len < 1:
            raise APIError(400, "The prompt is empty.", param="prompt")
        room = me.max_model_len - prompt_len
        if requested is None and room >= 1:
            return room
        if requested is None or requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {me.max_model_len} tokens. "
                f"However, you requested {prompt_len + (requested or 1)} tokens ({prompt_len} in "
                f"the messages, {requested or 1} in the completion). Please reduce the length.",
                param="max_tokens" if (requested or 0) > me.max_model_len else "messages",
                code="context_length_exceeded",
            )
        return requested

    def _submit(
        self,
        model: str,
        prompts: list[list[int]],
        req,
        max_tokens: list[int],
        logprobs: int | None,
        request_id: str,
    ) -> list[Choice]:
        choices: list[Choice] = []
        try:
            for p_i, ids in enumerate(prompts):
                for j in range(req.n):
                    index = p_i * req.n + j
                    params = req.sampling_params(max_tokens[p_i], logprobs, index=j)
                    stream = self.aengine.submit(model, ids, params, f"{request_id}-{index}")
                    choices.append(Choice(index, ids, stream))
        except BaseException as e:
            for c in choices:
                c.stream.aclose_sync()
            if isinstance(e, ContextLengthExceeded):
                raise APIError(400, str(e), code="context_length_exceeded") from None
            if isinstance(e, ModelNotFound):
                raise _not_found(model) from None
            if isinstance(e, ModelFailed):
                raise APIError(
                    503, str(e), "server_error", param="model", code="model_load_failed"
                ) from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise
        return choices

    async def _respond(
        self,
        request: web.Request,
        req,
        choices: list[Choice],
        rid: str,
        model: str,
        chunk_fn,
        choice_fn,
        final_fn,
    ) -> web.StreamResponse:
        try:
            if not req.stream:
                await asyncio.gather(*(self._collect(c) for c in choices))
                failed = [c for c in choices if c.error]
                if failed:
                    raise APIError(500, f"Generation failed: {failed[0].error}", "server_error")
                return web.json_response(final_fn(choices))
            return await self._stream(request, req, choices, rid, model, chunk_fn, choice_fn)
        finally:
            for c in choices:
                c.stream.aclose_sync()

    @staticmethod
    async def _collect(c: Choice) -> None:
        async for out in c.stream:
            c.add(out)

    async def _stream(self, request, req, choices, rid, model, chunk_fn, choice_fn):
        created = now()
        sse = SSEWriter(request)
        await sse.prepare()
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            async for out in c.stream:
                await merged.put((c, out))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            for first in choice_fn.first(choices):
                await sse.send(chunk_fn(rid, created, model, [first]))
            remaining = len(choices)
            while remaining:
                c, out = await merged.get()
                c.add(out)
                if out.finished:
                    remaining -= 1
                    if out.error:
                        await sse.send(
                            {
                                "error": {
                                    "message": f"Generation failed: {out.error}",
                                    "type": "server_error",
                                    "param": None,
                                    "code": None,
                                }
                            }
                        )
                        continue
                if out.new_text or out.finished or out.logprobs:
                    await sse.send(chunk_fn(rid, created, model, [choice_fn.delta(c, out)]))
            if req.include_usage:
                p = sum(len(c.prompt_ids) for c in choices[:: req.n])
                g = sum(len(c.token_ids) for c in choices)
                await sse.send(chunk_fn(rid, created, model, [], usage(p, g)))
            await sse.done()
        except ConnectionResetError:  # the client went away mid-stream: abort quietly
            pass
        finally:
            for t in tasks:
                t.cancel()
        return sse.response

    # ---- chat ---------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        req, me = await self._parse(request, ChatCompletionRequest)
        tok = me.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(
                400,
                f"The model `{req.model}` has no chat template; use /v1/completions for it.",
                param="model",
            )
        ids = await asyncio.to_thread(_chat_ids, tok, req.chat_messages())
        max_tokens = self._max_tokens(me, req.requested_max_tokens, len(ids))
        rid = _request_id(request, "chatcmpl")
        choices = self._submit(req.model, [ids], req, [max_tokens], req.num_logprobs, rid)
        fmt = LogprobFormatter(tok)
        return await self._respond(
            request,
            req,
            choices,
            rid,
            req.model,
            chat_chunk,
            _ChatChoices(fmt, req.num_logprobs is not None),
            lambda cs: _chat_response(rid, req, cs, fmt),
        )

    # ---- completions --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req, me = await self._parse(request, CompletionRequest)
        vocab = me.model_config.vocab_size
        for p in req.prompts():
            if not isinstance(p, str) and any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"Token ids must be in [0, {vocab}).", param="prompt")
        # tokenizing long prompts takes a while: off the event loop
        prompts = await asyncio.to_thread(
            lambda: [
                list(me.tokenizer(p).input_ids) if isinstance(p, str) else list(p)
                for p in req.prompts()
            ]
        )
        max_tokens = [self._max_tokens(me, req.requested_max_tokens, len(p)) for p in prompts]
        rid = _request_id(request, "cmpl")
        choices = self._submit(req.model, prompts, req, max_tokens, req.logprobs, rid)
        fmt = LogprobFormatter(me.tokenizer)
        echo = [me.tokenizer.decode(p) if req.echo else "" for p in prompts]
        return await self._respond(
            request,
            req,
            choices,
            rid,
            req.model,
            completion_chunk,
            _CompletionChoices(fmt, echo, req.n),
            lambda cs: _completion_response(rid, req, cs, fmt, echo),
        )


def _chat_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    """The chat template applied and tokenized (run off the event loop)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja errors: roles the template refuses, etc.
        raise APIError(
            400, f"The messages do not fit the model's chat template: {e}", param="messages"
        ) from None
    return list(tok(text, add_special_tokens=False).input_ids)


def _not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def _request_id(request: web.Request, prefix: str) -> str:
    given = request.headers.get("X-Request-Id")
    return given if given and len(given) <= 256 else f"{prefix}-{uuid.uuid4().hex}"


class _ChatChoices:
    def __init__(self, fmt: LogprobFormatter, logprobs: bool):
        self.fmt, self.logprobs = fmt, logprobs

    def first(self, choices: list[Choice]) -> list[dict]:
        return [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in choices
        ]

    def delta(self, c: Choice, out: RequestOutput) -> dict:
        lp = self.fmt.chat(out.logprobs) if self.logprobs and out.logprobs else None
        delta = {"content": out.new_text} if out.new_text else {}
        return {
            "index": c.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason(out.finish_reason) if out.finished else None,
        }


class _CompletionChoices:
    def __init__(self, fmt: LogprobFormatter, echo: list[str], n: int):
        self.fmt, self.echo, self.n = fmt, echo, n

    def first(self, choices: list[Choice]) -> list[dict]:
        return [
            {
                "index": c.index,
                "text": self.echo[c.index // self.n],
                "logprobs": None,
                "finish_reason": None,
            }
            for c in choices
            if self.echo[c.index // self.n]
        ]

    def delta(self, c: Choice, out: RequestOutput) -> dict:
        lp = None
        if out.logprobs:
            lp = self.fmt.completion(out.logprobs, len(c.text) - len(out.new_text))
        return {
            "index": c.index,
            "text": out.new_text,
            "logprobs": lp,
            "finish_reason": finish_reason(out.finish_reason) if out.finished else None,
        }


def _chat_response(
    rid: str, req: ChatCompletionRequest, choices: list[Choice], fmt: LogprobFormatter
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": req.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": fmt.chat(c.logprobs) if req.num_logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(len(choices[0].prompt_ids), sum(len(c.token_ids) for c in choices)),
    }


def _completion_response(
    rid: str, req: CompletionRequest, choices: list[Choice], fmt: LogprobFormatter, echo: list[str]
) -> dict:
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[:: req.n])
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": req.model,
        "choices": [
            {
                "index": c.index,
                "text": echo[c.index // req.n] + c.text,
                "logprobs": (
                    fmt.completion(c.logprobs, len(echo[c.index // req.n]))
                    if req.logprobs is not None
                    else None
                ),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }
