"""ServedModel: the frontend's handle on one configured model. It holds what requests need before
they reach a device (the spec, tokenizer, chat template, limits, SLOs) and outlives the model's
residency: the tokenizer stays when the weights leave the GPU. One lookup per request, one place
that applies the chat template, one length check (CLI and server share them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prism_server import tools
from prism_server.config import ModelSpec

# fill-in-the-middle markers (prefix, suffix, middle) by tokenizer family: StarCoder / SantaCoder /
# DeepSeek-Coder-V2 style, and Qwen2.5-Coder style; a prompt is prefix, suffix, then middle (PSM)
FIM_MARKERS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


class RequestRejected(ValueError):
    """A request this model can never run, with the request field to blame."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ContextLengthExceeded(RequestRejected):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param, "context_length_exceeded")


class ModelFailed(RuntimeError):
    """A configured model that could not be loaded; requests for it get this error."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"The model `{name}` failed to load: {reason}")
        self.name, self.reason = name, reason


class ModelNotFound(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model `{self.name}` does not exist."


@dataclass(frozen=True)
class ServedModel:
    spec: ModelSpec
    device: str = ""  # where its worker lives
    tokenizer: object | None = None  # None when the model failed to load
    max_model_len: int = 0  # prompt + output tokens
    max_kv_tokens: int = 0  # the longest sequence its KV can ever hold on its device
    vocab_size: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    error: str | None = None  # why it failed to load
    grammars: object | None = None  # its structured-output compiler (prism_server.grammar)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # ---- prompts (may take a while for long inputs: call off the event loop) -------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """A text prompt tokenized as-is (special tokens such as BOS added), or token ids checked
        against the vocabulary."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):  # C loops: 1k ids
            raise RequestRejected(f"Token ids must be in [0, {self.vocab_size}).", "prompt")
        return list(prompt)

    @functools.cached_property
    def fim_markers(self) -> tuple[str, str, str] | None:
        """This tokenizer's fill-in-the-middle markers, or None if it has none (looked up once:
        a vocabulary's dict takes a while to build)."""
        vocab = self.tokenizer.get_vocab()
        return next((m for m in FIM_MARKERS if all(t in vocab for t in m)), None)

    def encode_fim(self, prompt: str | list[int], suffix: str) -> list[int]:
        """A completion between `prompt` and `suffix` (prefix, suffix, middle), tokenized."""
        markers = self.fim_markers
        if markers is None:
            raise RequestRejected(
                f"The model `{self.name}` has no fill-in-the-middle tokens, which suffix needs.",
                "suffix",
            )
        if not isinstance(prompt, str):
            raise RequestRejected("suffix needs a text prompt, not token ids.", "suffix")
        pre, suf, mid = markers
        return self.encode(f"{pre}{prompt}{suf}{suffix}{mid}")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    @functools.cached_property
    def _tool_support(self) -> tuple[str, str | None] | None:
        """(format, the template to use instead of its own or None), or None (tools.tool_format),
        looked up once."""
        return tools.tool_format(getattr(self.tokenizer, "chat_template", None))

    @property
    def tool_format(self) -> str | None:
        """The tool-call format its chat template speaks ("qwen_3", "llama"; prism_server.tools),
        or None if Prism cannot call tools through it."""
        return self._tool_support[0] if self._tool_support else None

    @functools.cached_property
    def thinks(self) -> bool:
        """Whether its chat template opens answers with a <think> block (Qwen3)."""
        return "<think>" in (getattr(self.tokenizer, "chat_template", None) or "")

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tool_defs: list[dict] | None = None,
        with_tools: bool = False,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The chat template applied (with the generation prompt, or continuing the last
        message) and tokenized. with_tools: the prompt has tools (`tool_defs`, None when they
        may not be called) or tool calls in its history, so the template must know them (400
        for a model whose template does not); template_kwargs: more variables for the template
        (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        if not self.has_chat_template:
            raise RequestRejected(
                f"The model `{self.name}` has no chat template; use /v1/completions for it.",
                "model",
            )
        tok = self.tokenizer
        template = None
        if with_tools:
            found = self._tool_support
            if found is None:
                raise RequestRejected(
                    f"The model `{self.name}` has no tool-calling chat template.", "tools"
                )
            template = found[1]
        try:
            text = tok.apply_chat_template(
                messages,
                tools=tool_defs,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja errors: roles the template refuses, etc.
            raise RequestRejected(
                f"The messages do not fit the model's chat template: {e}", "messages"
            ) from None
        return list(tok(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def compile_grammar(self, spec):
        """A request's structured output compiled for this model (takes a while: off the loop)."""
        return self.grammars.compile(spec)

    def check_params(self, params) -> None:
        """Token ids the sampling parameters name (stop_token_ids, logit_bias) exist."""
        for t in params.token_ids:
            if not 0 <= t < self.vocab_size:
                param = "stop_token_ids" if t in params.stop_token_ids else "logit_bias"
                raise RequestRejected(f"Token id {t} is not in [0, {self.vocab_size}).", param)

    # ---- limits ---------------------------------------------------------------------------------
    def check(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        fields: tuple[str, str] = ("prompt", "max_tokens"),
    ) -> int:
        """The number of tokens to generate (`max_tokens`, or as many as fit when None), or
        RequestRejected if a request of this size can never run on this model. fields: the
        request's names of the prompt and of max_tokens, which an error names."""
        prompt, most = fields
        if num_prompt_tokens < 1:
            raise RequestRejected("The prompt is empty.", "prompt")
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None and room >= 1:
            max_tokens = room
        if max_tokens is None or max_tokens > room:
            asked = max_tokens or 1
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the "
                f"{prompt}, {asked} in the completion). Please reduce the length.",
                most if asked > self.max_model_len else prompt,
            )
        if num_prompt_tokens + max_tokens > self.max_kv_tokens:
            raise ContextLengthExceeded(
                f"{num_prompt_tokens + max_tokens} tokens do not fit in the KV cache this model "
                f"can address ({self.max_kv_tokens} tokens).",
                most,
            )
        return max_tokens
