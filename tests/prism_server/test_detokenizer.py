from __future__ import annotations

import pytest

from models.tokenizer import ByteTokenizer
from prism_server.engine.detokenizer import IncrementalDetokenizer, find_stop
from prism_server.engine.output_processor import OutputProcessor
from scheduler.request import FinishReason, Request, TokenLogprob
from scheduler.sampling_params import SamplingParams


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


def _stream(text: str, stop=(), min_tokens: int = 0):
    """Each token of `text` through OutputProcessor, as the engine feeds it: -> (the request,
    its deltas)."""
    tok = ByteTokenizer(vocab_size=300)
    ids = tok(text, add_special_tokens=False).input_ids
    params = SamplingParams(
        max_tokens=len(ids), stop=tuple(stop), min_tokens=min_tokens, ignore_eos=True, logprobs=0
    )
    req = Request("r", [65, 66], params, frozenset(), 0.0)
    proc = OutputProcessor(tok, max_model_len=1 << 20)
    outs = []
    for t in ids:
        reason, visible = proc.accept(req, t)
        outs.append(proc.render(req, t, TokenLogprob(t, -0.5, []), reason, visible))
        if outs[-1].finished:
            break
    return tok, req, outs


@pytest.mark.parametrize("stop", [(), ("zz",), ("café —",)])
def test_each_deltas_logprobs_are_the_tokens_of_its_text(stop):
    tok, req, outs = _stream("naïve café — 東京 done", stop)
    sent = [lp.token_id for o in outs for lp in o.logprobs or []]
    assert sent == req.output_token_ids  # every token's logprob, once, in order
    for o in outs[:-1]:  # before the end: a delta's text is exactly its tokens' text
        ids = [lp.token_id for lp in o.logprobs or []]
        assert tok.decode(ids) == o.new_text and bool(ids) == bool(o.new_text)


def test_min_tokens_holds_back_stop_strings_as_it_holds_eos():
    text = "ab stop cd stop ef"
    _, _, outs = _stream(text, stop=("stop",))
    assert "".join(o.new_text for o in outs) == "ab "
    # (a stop string the min_tokens-th token completes counts, as in vLLM)
    _, _, outs = _stream(text, stop=("stop",), min_tokens=len("ab stop"))
    assert "".join(o.new_text for o in outs) == "ab "
    _, _, outs = _stream(text, stop=("stop",), min_tokens=len("ab stop") + 1)
    assert "".join(o.new_text for o in outs) == "ab stop cd "
    assert outs[-1].finish_reason == FinishReason.STOP


def test_text_offsets_count_the_text_a_skipped_special_token_leaves_out():
    from prism_server.serving.protocol import LogprobFormatter

    tok = ByteTokenizer(vocab_size=300)
    ids = tok("hi", add_special_tokens=False).input_ids
    lps = [TokenLogprob(i, -1.0, []) for i in [*ids, 0, *ids]]  # 0: <pad>, a special token
    text = tok.decode([*ids, 0, *ids], skip_special_tokens=True)
    fmt = LogprobFormatter(tok)
    got = fmt.completion(lps, 0)
    assert text == "hihi" and got["tokens"][2] == "<pad>"
    assert got["text_offset"] == [0, 1, 2, 2, 3]  # the pad's: where the next text starts
    assert fmt.text_length(lps) == len(text)
    kept = LogprobFormatter(tok, skip_special=False)
    assert kept.completion(lps, 0)["text_offset"][-1] == len(tok.decode([*ids, 0, ids[0]]))
