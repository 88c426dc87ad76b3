"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""

from __future__ import annotations

# Prompt tokens decoded along with the output so that the first output token gets its leading
# space right (SentencePiece and byte-level BPE both depend on the left context).
_CONTEXT_TOKENS = 6


try:  # tokenizers >= 0.21: incremental decoding in Rust, ~8x cheaper per token
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover
    DecodeStream = None


def _decode_stream(context: list[int], skip_special_tokens: bool):
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # older tokenizers: no left context
        return DecodeStream(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    With a fast tokenizer it uses the tokenizers library's DecodeStream; otherwise it decodes a
    short window (prefix_offset..end) per token, so a step costs O(window). Either way text ending
    in an incomplete multi-byte character is held back until a later token completes it.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if DecodeStream is not None and self._backend is not None:
            self._stream = _decode_stream(self.ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def step(self, new_ids: list[int]) -> str:
        """Append new token ids; return the text they complete."""
        self.ids.extend(new_ids)
        if self._stream is not None:
            try:
                return "".join(self._stream.step(self._backend, i) or "" for i in new_ids)
            except Exception:  # an id the tokenizer cannot decode: fall back to windows
                self._stream = None
                self.prefix_offset = self.read_offset = len(self.ids) - len(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back (the stream drops an unfinished character)."""
        if self._stream is not None:
            return ""
        return self._delta(final=True)


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text` that the last `new_len`
    characters completed, or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
