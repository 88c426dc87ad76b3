"""Turns one step's sampled tokens into request updates and output deltas: stop conditions,
incremental text, stop strings (held back until they cannot be the start of a stop string; each
token's logprob held back with its text, so that a delta's logprobs are those of its text's
tokens). A request's final output carries its account: where its time went, its preemptions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prism_server.engine import wait_causes
from prism_server.engine.detokenizer import IncrementalDetokenizer, find_stop
from scheduler.request import FinishReason, Request, RequestOutput, TokenLogprob


@dataclass
class _Text:
    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    # logprobs not sent yet, each with the length of `text` that sends it
    held: list[tuple[TokenLogprob, int]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._texts: dict[str, _Text] = {}

    def _state(self, req: Request) -> _Text:
        st = self._texts.get(req.request_id)
        if st is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
            )
            st = self._texts[req.request_id] = _Text(detok)
        return st

    def _token_stop(self, req: Request, tok: int) -> tuple[FinishReason | None, bool]:
        """(finish reason, whether the token's text is part of the output)."""
        p = req.params
        stop_tok = tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_token_ids)
        if stop_tok and req.num_output_tokens > p.min_tokens:  # sampled after min_tokens
            return FinishReason.STOP, False
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, True
        return None, True

    def accept(
        self, req: Request, tok: int, complete: bool = False
    ) -> tuple[FinishReason | None, bool]:
        """Append a sampled token and decide from token ids alone whether the request ends
        (EOS, stop ids, length; complete: its grammar is complete with this token). -> (finish
        reason or None, whether the token's text is part of the output). `render` makes its
        text."""
        req.append_token(tok)
        reason, visible = self._token_stop(req, tok)
        if complete and reason is None:  # the grammar's end (under ignore_eos): EOS is not text
            reason, visible = FinishReason.STOP, tok not in req.eos_token_ids
        return reason, visible

    def render(
        self,
        req: Request,
        tok: int,
        logprob: TokenLogprob | None,
        reason: FinishReason | None,
        visible: bool,
    ) -> RequestOutput:
        """The delta of the latest token `accept` took (with finish_reason set if it finished):
        its text, and the stop strings, which may end the request here."""
        st = self._state(req)
        new = st.detok.step([tok]) if visible else ""
        if reason is not None:
            new += st.detok.flush()
        st.text += new
        if logprob is not None:  # a token of no text yet goes out with the next text
            st.held.append((logprob, len(st.text) + (0 if new else 1)))
        stops = req.params.stop
        if stops and req.num_output_tokens >= req.params.min_tokens:  # none looked for before
            hit = find_stop(st.text, len(new), stops)
            if hit is not None:
                i, s = hit
                st.text = st.text[: i + (len(s) if req.params.include_stop_str_in_output else 0)]
                reason = FinishReason.STOP
        hold = 0 if reason or not stops else max(len(s) for s in stops) - 1
        upto = max(st.emitted, len(st.text) - hold)
        delta, st.emitted = st.text[st.emitted : upto], upto
        n = len(st.held) if reason else sum(1 for _, end in st.held if end <= upto)
        logprobs = [lp for lp, _ in st.held[:n]] if n else None
        del st.held[:n]
        if reason is not None:
            req.finish_reason = reason
            del self._texts[req.request_id]
        first = req.num_output_tokens == 1
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=[tok],
            new_text=delta,
            logprobs=logprobs,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            first_scheduled_time=req.first_scheduled_time,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=(
                list(req.prompt_logprobs)
                if first and req.params.prompt_logprobs is not None
                else None
            ),
        )
        return _closed(req, out) if reason is not None else out

    def final(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """The closing delta of a request finished outside sampling (abort, error)."""
        self._texts.pop(req.request_id, None)
        out = RequestOutput(
            req.request_id,
            [],
            "",
            None,
            True,
            reason,
            req.num_prompt_tokens,
            req.num_output_tokens,
            error,
        )
        closed = _closed(req, out)  # by its state before it ends
        req.finish_reason = reason
        return closed


def _closed(req: Request, out: RequestOutput) -> RequestOutput:
    """out, the final output of req, with req's account: its time charged up to now (its last
    interval by its state), its first token's time, its preemptions."""
    wait_causes.charge(req, wait_causes.closing_cause(req), time.monotonic())
    out.waits = dict(req.waits)
    out.first_token_time = req.first_token_time
    out.num_preemptions = req.num_preemptions
    out.recomputed_tokens = req.recomputed_tokens
    return out
