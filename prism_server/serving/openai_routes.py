"""OpenAI routes: the route table and one thin handler per endpoint (parse -> look up -> encode
and check -> submit -> answer). Shared steps are in serving.py, JSON shapes in protocol/."""

from __future__ import annotations

from aiohttp import web

from prism_server import __version__
from prism_server.served_model import ServedModel
from prism_server.serving import serving
from prism_server.serving.frontend import Frontend
from prism_server.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatShapes,
    CompletionRequest,
    CompletionShapes,
    DetokenizeRequest,
    LogprobFormatter,
    TokenizeRequest,
    model_card,
    now,
)


class OpenAIRoutes:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.engine = frontend.engine
        self.created = now()

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model_id:.+}", self.get_model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)

    # ---- models ---------------------------------------------------------------------------------
    def _card(self, served: ServedModel, residency: dict[str, str]) -> dict:
        if served.failed:
            return model_card(served.name, self.created, status="failed", error=served.error)
        spec = served.spec
        if spec.is_adapter:  # vLLM's shape: root its directory, parent its base's id
            return model_card(
                served.name,
                self.created,
                root=spec.adapter,
                parent=spec.base,
                max_model_len=served.max_model_len,
                status=residency.get(served.name, "loading"),
                policy=self.engine.config.policy,
            )
        return model_card(
            served.name,
            self.created,
            root=spec.source,
            parent=None,
            max_model_len=served.max_model_len,
            status=residency.get(served.name, "loading"),
            policy=self.engine.config.policy,
        )

    def _residency(self) -> dict[str, str]:
        """Each model's residency; an adapter's: resident (its pages mapped) or offloaded."""
        out = {}
        for snap in self.engine.snapshots():
            for m in snap.models:
                out[m.name] = m.residency.value
                for a in m.adapters:
                    out[a.name] = a.residency
        return out

    async def list_models(self, request: web.Request) -> web.Response:
        """Every configured model, in config order (failed ones included)."""
        res = self._residency()
        cards = [self._card(s, res) for s in self.engine.served.values()]
        return web.json_response({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        served = self.engine.served.get(name)
        if served is None:
            raise serving.not_found(name)
        return web.json_response(self._card(served, self._residency()))

    # ---- vLLM's utility endpoints ----------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        req = await serving.parse(request, TokenizeRequest)
        served = serving.lookup(self.engine, req.model)
        if req.messages is not None:
            chat = req.chat()
            messages = chat.chat_messages()
            special = bool(req.add_special_tokens)

            def encode() -> list[int]:
                ids = _encode_chat(served, chat, messages)
                if special and served.tokenizer.bos_token_id is not None:
                    ids = [served.tokenizer.bos_token_id, *ids]
                return ids

        else:
            special = req.add_special_tokens is not False

            def encode() -> list[int]:
                return served.tokenize(req.prompt, special)

        ids = await serving.off_loop(encode)
        strs = served.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = {
            "count": len(ids),
            "max_model_len": served.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        return web.json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await serving.parse(request, DetokenizeRequest)
        served = serving.lookup(self.engine, req.model)
        if any(not 0 <= t < served.vocab_size for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {served.vocab_size}).", param="tokens")
        text = await serving.off_loop(lambda: served.decode(req.tokens))
        return web.json_response({"prompt": text})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    # ---- generation -----------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await serving.parse(request, ChatCompletionRequest)
        served = await serving.resolve(self.engine, req.model)
        messages = req.chat_messages()
        ids = await serving.off_loop(lambda: _encode_chat(served, req, messages))
        max_tokens = serving.check(served, len(ids), req)
        tool_format = served.tool_format if req.calls_tools else None
        grammar = await serving.compile_grammar(served, req, tool_format, served.thinks)
        rid = serving.response_id(request, "chatcmpl")
        choices = await serving.submit_choices(
            self.frontend, served, [ids], [max_tokens], req, req.num_logprobs, grammar, rid
        )
        fmt = LogprobFormatter(served.tokenizer, req.skip_special_tokens)
        shapes = ChatShapes(
            rid,
            req.model,
            fmt,
            req.num_logprobs is not None,
            tool_format,
            req.parallel_tool_calls is not False,
        )
        return await serving.respond(request, req, choices, shapes, len(ids))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await serving.parse(request, CompletionRequest)
        served = await serving.resolve(self.engine, req.model)
        raw = req.prompts()
        if req.suffix:  # fill in the middle, between each prompt and the suffix

            def encode(p):
                return served.encode_fim(p, req.suffix)
        else:
            encode = served.encode
        prompts = await serving.off_loop(lambda: [encode(p) for p in raw])
        max_tokens = [serving.check(served, len(p), req) for p in prompts]
        grammar = await serving.compile_grammar(served, req)
        rid = serving.response_id(request, "cmpl")
        choices = await serving.submit_choices(
            self.frontend, served, prompts, max_tokens, req, req.logprobs, grammar, rid
        )
        fmt = LogprobFormatter(served.tokenizer, req.skip_special_tokens)
        # echo: the prompt as sent (text as it came, token ids decoded; no BOS added)
        echo = [(p if isinstance(p, str) else served.decode(p)) if req.echo else "" for p in raw]
        bos = served.tokenizer.bos_token_id
        bos_added = [isinstance(p, str) and ids[:1] == [bos] for p, ids in zip(raw, prompts)]
        shapes = CompletionShapes(
            rid, req.model, fmt, req.logprobs is not None, echo, req.n, bos_added
        )
        return await serving.respond(request, req, choices, shapes, sum(map(len, prompts)))


def _encode_chat(served, chat: ChatCompletionRequest, messages: list[dict]) -> list[int]:
    """A chat's prompt tokens: its messages (`chat.chat_messages()`) through the model's
    template with the chat's tools and template arguments (takes a while: off the loop)."""
    return served.encode_chat(
        messages,
        chat.add_generation_prompt,
        chat.tool_defs(),
        chat.uses_tools,
        chat.continue_final_message,
        chat.chat_template_kwargs,
    )
