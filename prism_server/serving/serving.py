"""What both OpenAI generation endpoints share: reading the body, looking the model up, turning
the engine's refusals into API errors, submitting the n choices, and answering them whole or as an
SSE stream. The JSON itself comes from protocol/."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel, ValidationError

from prism_server.completion import Completion
from prism_server.engine.engine import AdapterError, Engine
from prism_server.served_model import ModelFailed, ModelNotFound, RequestRejected, ServedModel
from prism_server.serving.frontend import Frontend, RequestStream, overloaded
from prism_server.serving.middlewares import MODEL, USAGE, client_request_id
from prism_server.serving.protocol import APIError, stream_error, validation_error
from prism_server.serving.sse import SSEWriter

log = logging.getLogger(__name__)


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except web.HTTPRequestEntityTooLarge:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    bad = _invalid_text(body)
    if bad is not None:
        raise APIError(
            400,
            f"{bad or 'The body'}: the text is not valid Unicode (it holds a lone surrogate).",
            param=bad or None,
        )
    return body


def _invalid_text(value, path: str = "") -> str | None:
    """The path (`messages.0.content`) of the first string, or key, that is not valid Unicode
    (a lone surrogate: valid JSON, but no UTF-8 encoding and no tokenizer takes it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        if isinstance(k, str) and _invalid_text(k) is not None:
            k = k.encode("utf-8", "backslashreplace").decode()  # named, as valid text
            return f"{path}.{k}" if path else k
        where = f"{path}.{k}" if path else str(k)
        found = _invalid_text(v, where)
        if found is not None:
            return found
    return None


async def parse(request: web.Request, cls: type[BaseModel]):
    try:
        req = cls.model_validate(await read_json(request))
    except ValidationError as e:
        raise validation_error(e) from None
    req.check()
    return req


def not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def lookup(engine: Engine, name: str) -> ServedModel:
    """The one lookup of a request's model: 404 if unknown, 503 if it failed to load."""
    try:
        return engine.model(name)
    except ModelNotFound:
        raise not_found(name) from None
    except ModelFailed as e:
        raise APIError(
            503, str(e), "server_error", param="model", code="model_load_failed"
        ) from None


def bad_adapter(e: Exception) -> APIError:
    """An adapter that cannot be served (models.lora's AdapterError, a taken name): 400."""
    return APIError(400, str(e), param="lora_path", code="invalid_adapter")


async def resolve(engine: Engine, name: str) -> ServedModel:
    """`lookup`, and for a name that is no served model but an adapter's directory in
    lora_dirs: that adapter loaded first (vLLM's filesystem resolver; 400 if it is bad)."""
    try:
        return lookup(engine, name)
    except APIError as e:
        path = engine.adapters.find(name) if e.status == 404 else None
        if path is None:
            raise
    try:
        # shielded: a client that goes away does not cancel the load other requests may wait on
        loading = engine.adapters.start_load(name, str(path), join_any=True)
        await asyncio.shield(asyncio.wrap_future(loading))
    except AdapterError as e:
        raise APIError(400, str(e), param="model", code="invalid_adapter") from None
    except ValueError:  # loaded meanwhile by another request
        pass
    except MemoryError as e:
        raise APIError(
            503, str(e), "server_error", param="model", code="insufficient_memory"
        ) from None
    return lookup(engine, name)


def rejected(e: RequestRejected) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


async def off_loop(fn):
    """Tokenizing long prompts takes a while: run it off the event loop, refusals as 400."""
    try:
        return await asyncio.to_thread(fn)
    except RequestRejected as e:
        raise rejected(e) from None


async def compile_grammar(served: ServedModel, req, *args):
    """The request's structured output (or its tool calls' grammar: args) compiled for the
    model (off the loop; 400 if it cannot be), or None when it asks for none."""
    spec = req.grammar_spec(*args)
    return None if spec is None else await off_loop(lambda: served.compile_grammar(spec))


def check(served: ServedModel, prompt_len: int, req) -> int:
    """ServedModel.check for a chat or completions request, its error naming the request's
    fields."""
    try:
        return served.check(prompt_len, req.requested_max_tokens, req.length_fields)
    except RequestRejected as e:
        raise rejected(e) from None


def response_id(request: web.Request, prefix: str) -> str:
    """The `id` of the response: the client's X-Request-Id, echoed (never used as a key), or a
    new one."""
    return client_request_id(request) or f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One output choice being assembled: its index in the response and its request stream."""

    index: int
    stream: RequestStream
    completion: Completion


async def submit_choices(frontend: Frontend, served: ServedModel, *args) -> list[Choice]:
    """`_submit_choices`; for an adapter unloaded since its lookup that lora_dirs holds, loaded
    again (`resolve`) and submitted once more, as a request arriving now would be."""
    try:
        return _submit_choices(frontend, served, *args)
    except APIError as e:
        engine = frontend.engine
        if e.status != 404 or not served.spec.is_adapter or not engine.adapters.find(served.name):
            raise
    return _submit_choices(frontend, await resolve(engine, served.name), *args)


def _submit_choices(
    frontend: Frontend,
    served: ServedModel,
    prompts: list[list[int]],
    max_tokens: list[int],
    req,
    logprobs: int | None,
    grammar=None,
    response_id: str | None = None,
) -> list[Choice]:
    """n choices per prompt, submitted together: all accepted, or none (503 frees the rest).
    grammar: the compiled structured output (`compile_grammar`), None for free text;
    response_id: the id of the response (`response_id`), what the request log names them by."""
    frontend.check_batch(served, len(prompts) * req.n)
    try:
        served.check_params(req.sampling_params(max_tokens[0], logprobs))
    except RequestRejected as e:
        raise rejected(e) from None
    choices: list[Choice] = []
    try:
        for p_i, ids in enumerate(prompts):
            for j in range(req.n):
                params = req.sampling_params(max_tokens[p_i], logprobs, index=j, grammar=grammar)
                try:
                    stream = frontend.submit(served, ids, params)
                except ModelNotFound:  # an adapter unloaded since its lookup
                    raise not_found(served.name) from None
                stream.response_id = response_id
                if len(prompts) * req.n > 1:
                    stream.index = p_i * req.n + j
                completion = Completion(ids, arrival_time=stream.arrival)
                choices.append(Choice(p_i * req.n + j, stream, completion))
    except BaseException:
        for c in choices:
            c.stream.close()
        raise
    return choices


async def respond(
    request: web.Request, req, choices: list[Choice], shapes, prompt_tokens: int
) -> web.StreamResponse:
    """The whole response, or its SSE stream; every choice is released (aborted if unfinished)
    however this ends."""
    request[MODEL] = req.model
    try:
        if not req.stream:
            await _first_output(choices, idle=None)
            await asyncio.gather(*(_collect(c) for c in choices))
            failed = [c for c in choices if c.completion.error]
            if failed:
                raise APIError(
                    500, f"Generation failed: {failed[0].completion.error}", "server_error"
                )
            pairs = [(c.index, c.completion) for c in choices]
            return web.json_response(shapes.response(pairs, prompt_tokens))
        return await _stream(request, req, choices, shapes, prompt_tokens)
    finally:
        for c in choices:
            c.stream.close()
        request[USAGE] = (prompt_tokens, sum(len(c.completion.token_ids) for c in choices))


KEEPALIVE_S = 1.0  # a comment line this often while a model activates (proxies keep the stream)


async def _first_output(choices: list[Choice], idle) -> None:
    """Wait until some choice has output, calling idle() each KEEPALIVE_S meanwhile; past the
    model's max_wait_s (time enough to activate it, even after evictions) 503 + Retry-After."""
    stream = choices[0].stream
    limit = stream.served.spec.max_wait_s
    while not any(c.stream.has_output for c in choices):
        waited = time.monotonic() - stream.arrival
        if waited >= limit:
            raise overloaded(
                f"`{stream.model}` gave no first token within {limit:g} s (the server is busy "
                "or moving models); retry later."
            )
        waiters = [asyncio.ensure_future(c.stream.ready.wait()) for c in choices]
        try:
            await asyncio.wait(
                waiters,
                timeout=min(KEEPALIVE_S, limit - waited),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for w in waiters:
                w.cancel()
        if idle is not None and not any(c.stream.has_output for c in choices):
            await idle()


async def _collect(c: Choice) -> None:
    async for out in c.stream:
        c.completion.add(out, time.monotonic())


async def _stream(request, req, choices: list[Choice], shapes, prompt_tokens: int):
    sse = SSEWriter(request)
    await sse.prepare()
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        async for out in c.stream:
            await merged.put((c, out))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        await _send_stream(sse, req, choices, shapes, prompt_tokens, merged)
    except ConnectionResetError:  # the client went away mid-stream: abort quietly
        pass
    except Exception:  # anything after the 200 went out ends the stream as SSE says
        log.exception("stream failed after it started")
        await sse.fail("Internal server error.")
    finally:
        for t in tasks:
            t.cancel()
    return sse.response


async def _send_stream(sse: SSEWriter, req, choices, shapes, prompt_tokens: int, merged) -> None:
    try:
        await _first_output(choices, idle=lambda: sse.comment("loading"))
    except APIError as e:  # the 200 went out: the SSE way
        await sse.send(e.body())
        await sse.done()
        return
    pairs = [(c.index, c.completion) for c in choices]

    def so_far() -> dict | None:  # vLLM's continuous usage: every chunk's usage until now
        return shapes.usage(prompt_tokens, pairs) if req.continuous_usage else None

    for first in shapes.first([c.index for c in choices]):
        await sse.send(shapes.chunk([first], so_far()))
    remaining = len(choices)
    while remaining:
        c, out = await merged.get()
        c.completion.add(out, time.monotonic())
        if out.finished:
            remaining -= 1
            if out.error:
                await sse.send(stream_error(f"Generation failed: {out.error}"))
                continue
        if out.new_text or out.finished or out.logprobs:
            delta = shapes.delta(c.index, c.completion, out)
            if delta is not None:
                await sse.send(shapes.chunk([delta], so_far()))
    if req.include_usage:
        await sse.send(shapes.chunk([], shapes.usage(prompt_tokens, pairs)))
    await sse.done()
