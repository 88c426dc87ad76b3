"""Tokenizers: a byte-level tokenizer for dummy-weight models, and a loader for real ones.

`ByteTokenizer(vocab_size)` is a real `transformers.PreTrainedTokenizerFast` (so the server's chat
template, incremental detokenization and special-token handling run exactly as for a real model)
that encodes text as its UTF-8 bytes, one token per byte. Id layout:

    0 <pad> | 1 <s> (bos) | 2 <|im_end|> (eos) | 3 <|im_start|> | 4..259 bytes 0x00..0xff
    | 260..vocab_size-1 placeholders "<|id_N|>"

Placeholders exist so that every id a dummy model may sample decodes without error; text never
encodes to them (the BPE model has no merges, so only single byte symbols are ever produced).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START = "<pad>", "<s>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START)
BYTE_OFFSET = len(SPECIAL_TOKENS)  # id of byte 0x00
MIN_VOCAB_SIZE = BYTE_OFFSET + 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def _build_backend(vocab_size: int) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in enumerate(_bytes_to_unicode()):
        vocab[ch] = BYTE_OFFSET + b
    for i in range(MIN_VOCAB_SIZE, vocab_size):
        vocab[f"<|id_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class ByteTokenizer(PreTrainedTokenizerFast):
    """UTF-8 byte tokenizer with ChatML special tokens, covering ids [0, vocab_size)."""

    def __init__(self, vocab_size: int = MIN_VOCAB_SIZE, **kwargs) -> None:
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {MIN_VOCAB_SIZE}: {vocab_size}")
        kwargs.pop("tokenizer_object", None)
        super().__init__(
            tokenizer_object=_build_backend(vocab_size),
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            additional_special_tokens=[IM_START],
            chat_template=CHATML_TEMPLATE,
            clean_up_tokenization_spaces=False,
            **kwargs,
        )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in an HF-style directory, with an error that names the directory."""
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a missing/corrupt tokenizer
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
