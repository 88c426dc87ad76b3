"""Structured output: JSON (any object, or one JSON schema), regular expressions, a choice of
strings and EBNF grammars, compiled with xgrammar against a model's tokenizer and applied in the
sampler as a token bitmask (batched over the rows that carry one, on CPU and GPU).

The server compiles a request's grammar off the event loop and off the engine thread before it
submits (`Grammars.compile`, cached per grammar by xgrammar's compiler); the compiled grammar
travels in the request's SamplingParams, immutable. On the engine thread `Guides` keeps one matcher
per request, fills the masks before sampling and advances the matchers by the sampled tokens."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_server.served_model import RequestRejected

if TYPE_CHECKING:
    import torch

# what xgrammar prefixes its error messages with: "[time] /path/file.cc:123: Check failed: ..."
_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. kind: "json" (any JSON object), "json_schema",
    "regex", "choice" (one of `choices`), "ebnf" or "tools"; source: the schema (JSON text),
    the regex, the grammar, or for tools the format, tools and tool_choice (JSON text);
    param: the request field it came from (named in errors)."""

    kind: str
    source: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = True
    param: str = "response_format"


def _message(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return _NOISE.sub("", lines[0]).strip() if lines else type(e).__name__


class Grammars:
    """One model's grammar compiler (its vocabulary and stop tokens); thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None

    def _get(self):
        with self._lock:  # building the vocabulary's tables takes a while (seconds for 262k)
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; RequestRejected naming the problem if it does not compile."""
        c = self._get()
        try:
            if spec.kind == "json":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(
                    spec.source, any_whitespace=False, strict_mode=spec.strict
                )
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            if spec.kind == "choice":
                return c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(s) for s in spec.choices)
                )
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.source)
            if spec.kind == "tools":
                return c.compile_structural_tag(_tool_tag(json.loads(spec.source)))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            msg = f"The {spec.param} cannot be compiled: {_message(e)}"
            raise RequestRejected(msg, spec.param) from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _tool_tag(spec: dict):
    """xgrammar's structural tag for tool calls in a model's format: free text and calls whose
    arguments follow each function's schema (auto), one call or more (required), or the named
    function's call alone."""
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag(
        spec["format"],
        tools=spec["tools"],
        tool_choice=spec["tool_choice"],
        reasoning=spec.get("reasoning", "disabled"),
        parallel_tool_calls=spec["parallel_tool_calls"],
    )
    return _rewrite(tag, _tighten)


def _tighten(node):
    """Two changes to xgrammar's tool-call tags. Each JSON-schema part becomes its grammar
    without free whitespace (the layout of json.dumps), as response_format has it: the tag's
    own allows any whitespace, and a small model fills it with spaces. And calls that must come
    (required) come alone, one per line: the tag lets free text follow them, which a small model
    writes until max_tokens."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        GrammarFormat,
        JSONSchemaFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if isinstance(node, JSONSchemaFormat) and node.style == "json":
        schema = json.dumps(node.json_schema)
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        return GrammarFormat(grammar=str(grammar))
    if isinstance(node, TriggeredTagsFormat) and node.at_least_one:
        return TagsWithSeparatorFormat(
            tags=node.tags,
            separator="\n",
            at_least_one=True,
            stop_after_first=node.stop_after_first,
        )
    return node


def _rewrite(node, fn):
    """A pydantic tree with fn applied bottom-up to every node."""
    if isinstance(node, list):
        return [_rewrite(x, fn) for x in node]
    fields = getattr(type(node), "model_fields", None)
    if fields is not None:
        node = node.model_copy(update={k: _rewrite(getattr(node, k), fn) for k in fields})
    return fn(node)


class Guides:
    """The engine thread's matchers, one per constrained request (forgotten when it finishes)."""

    def __init__(self):
        self._matchers: dict[str, object] = {}

    def _matcher(self, req):
        m = self._matchers.get(req.request_id)
        if m is None:
            import xgrammar as xgr

            m = self._matchers[req.request_id] = xgr.GrammarMatcher(req.params.grammar)
        return m

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, reqs) -> None:
        """In place: each constrained row keeps only the tokens its grammar allows next."""
        rows = [i for i, r in enumerate(reqs) if r.params.constrained]
        if not rows:
            return
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(reqs), logits.shape[-1])
        for i in rows:
            self._matcher(reqs[i]).fill_next_token_bitmask(mask, i)
        xgr.apply_token_bitmask_inplace(
            logits, mask.to(logits.device, non_blocking=True), indices=rows
        )

    def accept(self, reqs, tokens: list[int]) -> set[str]:
        """Advances the constrained requests' matchers; the ids of those whose grammar is now
        complete (their output must end). A token the grammar refuses raises."""
        done = set()
        for r, tok in zip(reqs, tokens):
            if not r.params.constrained:
                continue
            m = self._matcher(r)
            if not m.accept_token(tok):
                raise RuntimeError(f"token {tok} breaks the grammar of request {r.request_id}")
            if m.is_terminated():
                done.add(r.request_id)
        return done
