from __future__ import annotations

import pytest

from models.tokenizer import ByteTokenizer
from prism_server.engine.detokenizer import IncrementalDetokenizer, find_stop


class WindowOnly:
    """The same tokenizer seen without its fast backend: the window-decoding path."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.mark.parametrize("wrap", [lambda t: t, WindowOnly], ids=["stream", "window"])
def test_incremental_text_equals_full_decode_and_never_splits_a_character(wrap):
    tok = ByteTokenizer(vocab_size=300)
    text = "naïve café — 東京 🚀 done"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    d = IncrementalDetokenizer(wrap(tok), prompt_ids=[])
    pieces = [d.step([i]) for i in ids]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_find_stop_reports_the_earliest_stop_the_new_text_completed():
    assert find_stop("hello world", 5, ("wor", "o w")) == (4, "o w")
    assert find_stop("hello world", 2, ("hello",)) is None  # completed earlier, not now
    assert find_stop("abc", 1, ("x",)) is None
