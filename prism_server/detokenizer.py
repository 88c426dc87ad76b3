"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""

from __future__ import annotations

# Prompt tokens decoded along with the output so that the first output token gets its leading
# space right (SentencePiece and byte-level BPE both depend on the left context).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Decodes only a short window (prefix_offset..end) per token, so a step costs O(window), and holds
    back text ending in U+FFFD (an incomplete multi-byte character) until a later token ends it.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

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
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back."""
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
