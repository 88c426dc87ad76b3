"""OpenAI request models: fields in the order of the OpenAI reference, then vLLM's extensions;
the field combinations OpenAI refuses, and the conversion into internal sampling parameters
(chat's requests: chat_requests.py).

A body is read as OpenAI reads it: a null field is its default, a value of the wrong JSON type
is refused (no "2" for 2), and so is a field this server does not know (OpenAI's
"Unrecognized request argument"). Fields it knows but does not honour are refused when set to
anything but their no-op value (`check`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prism_server.grammar import GrammarSpec
from prism_server.serving.protocol.responses import APIError
from scheduler.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 16
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class Body(BaseModel):
    """A request body's top level: unknown fields refused, a null field is its default."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: bool = False  # OpenAI's padding of chunks: not sent


class SamplingFields(Body):
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


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
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


class DetokenizeRequest(Body):
    model: str
    tokens: list[int]

    def check(self) -> None:
        pass
