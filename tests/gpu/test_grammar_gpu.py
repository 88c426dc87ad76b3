"""Structured output on the GPU: the grammar's bitmask applied to CUDA logits keeps exactly the
tokens the CPU path keeps, and a constrained greedy decode on the device follows its regex."""

from __future__ import annotations

import re

import pytest
import torch

from prism_server.grammar import Guides
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from tests.gpu.common import GPU

xgr = pytest.importorskip("xgrammar")
pytestmark = GPU

VOCAB = 256  # a byte-level vocabulary: token i is the byte i


def _compiled(regex: str):
    info = xgr.TokenizerInfo(
        [bytes([i]).decode("latin-1") for i in range(VOCAB - 1)] + ["</s>"],
        vocab_type=xgr.VocabType.RAW,
        vocab_size=VOCAB,
        stop_token_ids=[VOCAB - 1],
    )
    return xgr.GrammarCompiler(info).compile_regex(regex)


def _req(rid: str, grammar=None) -> Request:
    return Request(
        rid, [1], SamplingParams(max_tokens=20, temperature=0, grammar=grammar), frozenset(), 0.0
    )


def test_the_mask_on_cuda_logits_matches_the_cpu_and_the_decode_follows_the_regex():
    g = _compiled("[0-9]{3}-[0-9]{4}")
    cpu_r, gpu_r = [_req("c", g), _req("free")], [_req("g", g), _req("free2")]
    gc, gg = Guides(), Guides()
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(20):
        x = torch.randn(2, VOCAB, generator=gen)
        a, b = x.clone(), x.cuda()
        gc.mask(a, cpu_r)
        gg.mask(b, gpu_r)
        assert torch.equal(a, b.cpu())  # masked rows alike, the free row untouched
        tok = int(b[0].argmax())
        gc.accept(cpu_r[:1], [tok])
        if gg.accept(gpu_r[:1], [tok]):
            break
        out.append(tok)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", bytes(out).decode())
