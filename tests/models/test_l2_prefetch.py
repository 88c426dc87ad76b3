"""Weights asked into the L2 during a decode step's idle windows: which bytes each point asks
for (the plans), how the kernel cuts them into chunks (its build without the prefetch
instruction, run under Triton's interpreter: the instruction itself runs on Hopper only, in
tests/gpu/test_l2_prefetch_gpu.py), and where the forward issues them."""

from __future__ import annotations

import pytest
import torch

from models.attention import triton_ops
from models.attention.base import AttentionMetadata, ForwardContext, LayerAttention, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.layers import l2_prefetch
from models.layers.l2_prefetch import CHUNK, chunks, load_prefetcher, prefetch_plans
from models.loader import load_model
from models.presets import get_preset
from models.registry import get_model_class

pytest.importorskip("triton")


def expected_chunks(ranges):
    out = []
    for a, n in ranges:
        out += [(a + off, min(CHUNK, n - off)) for off in range(0, n, CHUNK)]
    return out


@pytest.mark.parametrize(
    "ranges",
    [
        [(1 << 40, 16)],
        [(1 << 40, CHUNK), (1 << 41, CHUNK + 16)],
        [(4096, 0), (1 << 33, 5 * CHUNK - 32)],  # an empty first range
        [(1 << 40, 70 * CHUNK + 48), (1 << 40 | 1 << 36, 3 * CHUNK)],  # several programs
        [(16, 32), (1 << 35, 2 * CHUNK), (1 << 36, 80)],  # three: two launches
    ],
)
def test_the_kernel_asks_for_each_byte_once(ranges):
    got = chunks(ranges)
    assert got == expected_chunks(ranges)
    assert all(n % 16 == 0 and 0 < n <= CHUNK and a % 16 == 0 for a, n in got)


def test_the_plans_take_the_next_weights_in_order_up_to_each_budget():
    model = load_model("dummy:tiny-llama").model
    layers = model.model.layers
    qkv = layers[0].self_attn.qkv_proj.weight
    o = layers[0].self_attn.o_proj.weight
    gate_up = layers[0].mlp.gate_up_proj.weight
    down = layers[0].mlp.down_proj.weight
    size = {w: w.numel() * w.element_size() for w in (qkv, o, gate_up, down)}

    plans = prefetch_plans(model, size[o] + 1000, 100, 50)
    assert len(plans) == 3 * len(layers) + 1
    assert plans[model.model.norm] == [(model.lm_head.weight.data_ptr(), 48)]  # the final norm
    for layer in layers:  # each layer's own weights
        attn, mlp = layer.self_attn, layer.mlp
        assert plans[layer] == [(attn.qkv_proj.weight.data_ptr(), 48)]  # rounded down to 16
        assert plans[attn] == [
            (attn.o_proj.weight.data_ptr(), size[o]),
            (mlp.gate_up_proj.weight.data_ptr(), 992),
        ]
        assert plans[mlp] == [(mlp.down_proj.weight.data_ptr(), 96)]
    # a budget past the weights takes them whole; a budget of 0, nothing at that point
    big = prefetch_plans(model, 1 << 40, 0)
    assert big[layers[1].self_attn] == [
        (layers[1].self_attn.o_proj.weight.data_ptr(), size[o]),
        (layers[1].mlp.gate_up_proj.weight.data_ptr(), size[gate_up]),
    ]
    assert layers[1].mlp not in big and layers[1] not in big and model.model.norm not in big
    assert prefetch_plans(model, 0, 0, 0) == {}
    small = prefetch_plans(model, 64, 1 << 30, 1 << 30)  # the head of o_proj only
    assert small[layers[0].self_attn] == [(o.data_ptr(), 64)]
    assert small[layers[0].mlp] == [(down.data_ptr(), size[down])]
    assert small[layers[0]] == [(qkv.data_ptr(), size[qkv])]


def test_gemma_layers_are_planned_too():
    cfg = ModelConfig.from_hf(get_preset("gemma-3-1b"))
    with torch.device("meta"):
        model = get_model_class(cfg.hf_architecture)(cfg)
    plans = prefetch_plans(model, 1 << 20, 1 << 20, 1 << 20)
    assert len(plans) == 3 * cfg.num_layers + 1  # and the final norm
    kinds = {type(m).__name__ for m in plans}
    assert kinds == {"Gemma3DecoderLayer", "SelfAttention", "GatedMLP", "RMSNorm"}


class Recorder:
    """Where a forward issues its points (the instruction itself needs a Hopper GPU); inline:
    the attention points are offered to a backend that takes them."""

    def __init__(self, inline=False):
        self.calls, self.inline = [], inline

    def issue(self, module):
        self.calls.append(module)

    def pair(self, module):
        return ((id(module), 16), (0, 0))

    def join(self):
        self.calls.append("join")


class TakingAttention(TorchPagedAttention):
    """The reference attention, taking the ranges a kernel would ask of the L2 (recorded)."""

    takes_prefetch = True

    def __init__(self, *a):
        super().__init__(*a)
        self.taken = []

    def forward(self, layer_idx, q, k, v, spec, prefetch=None):
        self.taken.append(prefetch)
        return super().forward(layer_idx, q, k, v, spec)


@torch.no_grad()
def test_a_forward_issues_each_point_in_order_and_joins_once_at_its_end():
    lm = load_model("dummy:tiny-llama")
    cfg, bs = lm.config, 4
    caches = [torch.zeros(3, 2, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    ids = torch.tensor([5, 17, 200, 3, 99])
    md = AttentionMetadata.build([SeqChunk(0, 5, [1, 2])], bs, torch.device("cpu"))
    plain = lm.model(ids, torch.arange(5), ForwardContext(attn=TorchPagedAttention(caches, md)))
    layers = lm.model.model.layers
    final = lm.model.model.norm
    every = [m for la in layers for m in (la, la.self_attn, la.mlp)] + [final, "join"]
    # on the side stream, whatever the backend, or inline where the backend takes them
    for inline, attn in (
        (False, TorchPagedAttention(caches, md)),
        (True, TorchPagedAttention(caches, md)),
        (False, TakingAttention(caches, md)),
    ):
        rec = Recorder(inline)
        hidden = lm.model(ids, torch.arange(5), ForwardContext(attn=attn, prefetcher=rec))
        assert rec.calls == every
        torch.testing.assert_close(hidden, plain, rtol=0, atol=0)
    rec, attn = Recorder(inline=True), TakingAttention(caches, md)
    hidden = lm.model(ids, torch.arange(5), ForwardContext(attn=attn, prefetcher=rec))
    assert rec.calls == [m for la in layers for m in (la, la.mlp)] + [final, "join"]
    assert attn.taken == [rec.pair(la.self_attn) for la in layers]
    torch.testing.assert_close(hidden, plain, rtol=0, atol=0)


def test_no_prefetcher_off_a_hopper_gpu():
    model = load_model("dummy:tiny-llama").model
    cpu = torch.device("cpu")
    assert load_prefetcher(model, cpu, (1 << 20, 0, 0)) == (None, "not a CUDA device")
    assert l2_prefetch.BLOCK == 32  # one chunk a thread of the kernel's one warp


@pytest.mark.parametrize("threads", [128, 1024, 3 * 128, 16 * 8 * 128])
def test_the_decode_kernel_asks_for_every_byte_within_its_threads(threads):
    for total in (0, 16, 32 << 20, 48 << 20, 300 << 20, 4096 * 16):
        chunk = triton_ops.prefetch_chunk(total, threads)
        assert chunk % 16 == 0 and chunk >= triton_ops.PF_CHUNK
        for n0 in (0, total // 3 // 16 * 16, total):
            n1 = total - n0
            assert -(-n0 // chunk) + -(-n1 // chunk) <= threads, (total, n0)


def test_the_decode_kernel_takes_no_prefetch_off_hopper():
    kernel = triton_ops.TritonDecodeKernel(4, 2, 32, 4, torch.device("cpu"))
    assert not kernel.takes_prefetch and not kernel.pdl
    cache = torch.zeros(2, 2, 4, 2, 32)
    q = torch.zeros(1, 4, 32)
    tables, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32)
    spec = LayerAttention(scale=1.0)
    with pytest.raises(AssertionError, match="needs Hopper"):
        kernel(q, cache, tables, lens, spec, prefetch=((1 << 40, 4096), (0, 0)))


def tiny_gemma():
    hf = get_preset("gemma-3-1b")
    hf.update(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], torch_dtype="float32",
    )  # fmt: skip
    cfg = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    return cfg, get_model_class(cfg.hf_architecture)(cfg)


class FailingAttention(TorchPagedAttention):
    """The reference attention until layer `at`, which raises."""

    def __init__(self, at, *a):
        super().__init__(*a)
        self.at = at

    def forward(self, layer_idx, q, k, v, spec, prefetch=None):
        if layer_idx == self.at:
            raise RuntimeError("a kernel failed")
        return super().forward(layer_idx, q, k, v, spec)


@torch.no_grad()
def test_gemma_issues_every_point_and_a_failed_forward_still_joins():
    cfg, lm = tiny_gemma()
    bs = 4
    caches = [torch.zeros(3, 2, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    ids = torch.tensor([5, 17, 200])
    md = AttentionMetadata.build([SeqChunk(0, 3, [1])], bs, torch.device("cpu"))
    layers = lm.model.layers
    every = [m for la in layers for m in (la, la.self_attn, la.mlp)] + [lm.model.norm, "join"]
    assert set(every[:-1]) == set(prefetch_plans(lm, 1 << 10, 1 << 10, 1 << 10))
    rec = Recorder()
    lm(ids, torch.arange(3), ForwardContext(attn=TorchPagedAttention(caches, md), prefetcher=rec))
    assert rec.calls == every
    # a step that raises between the fork and the join still joins (a capture would fail on
    # the unjoined side stream, hiding the step's own error)
    rec = Recorder()
    with pytest.raises(RuntimeError, match="a kernel failed"):
        lm(
            ids,
            torch.arange(3),
            ForwardContext(attn=FailingAttention(1, caches, md), prefetcher=rec),
        )
    assert rec.calls == every[:5] + ["join"]  # layer 1's attention point issued, then it raised
