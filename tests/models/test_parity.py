"""Parity of our models, run through the paged KV path, with transformers' own implementations.

Each case builds a tiny random HF model, loads its state_dict into ours, and runs three sequences
of different lengths as one batch: chunked prefill (chunks not aligned to blocks, prefill mixed
with decode in one step), then 8 decode steps fed with HF's greedy tokens, over shuffled
non-contiguous block tables. Our logits at every position must match HF's full-sequence forward.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

from kvpool import CpuBackend, KVLayout, PagedKV, PagePool
from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.registry import get_model_class

BLOCK_SIZE = 4
NUM_DECODE = 8
PROMPT_LENS = (20, 13, 7)
CHUNK_SIZES = (11, 13, 4)  # prefill tokens per step, per sequence
TOL = 1e-4

_COMMON = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,
    "attn_implementation": "eager",
}
_LLAMA3_ROPE = {  # original_max_position_embeddings small so the scaling bites at 28 tokens
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
}
HF_CASES = {
    "llama3": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON, rope_parameters=_LLAMA3_ROPE)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**_COMMON, sliding_window=6)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_COMMON, tie_word_embeddings=True)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**_COMMON, head_dim=32)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(
            **_COMMON,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=_GEMMA3_ROPE,
            final_logit_softcapping=5.0,
        )
    ),
}


def make_kv_cache(config: ModelConfig, num_blocks: int, block_size: int) -> PagedKV:
    """A real paged KV cache on a host page pool whose pages hold ~2 blocks per layer, so every
    sequence spans several pages; layer views: [num_blocks, 2, block_size, kv_heads, head_dim]."""
    block_bytes = 2 * block_size * config.num_kv_heads * config.head_dim * 4
    backend = CpuBackend()
    page = backend.round_up(2 * config.num_layers * block_bytes)
    pool = PagePool(backend, page, budget_bytes=page * (num_blocks + 2))
    layout = KVLayout(
        config.num_layers,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        page,
        backend.granularity,
    )
    return PagedKV(pool, "parity", layout, max_pages=num_blocks + 1, max_cached_pages=0)


def _tiny_hf_model(name: str) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    model = HF_CASES[name]().float().eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma's 1 + w): make them matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    return model


@torch.no_grad()
def _hf_greedy(hf: tf.PreTrainedModel, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Prompt + NUM_DECODE greedy tokens, and HF's logits at every position [len, vocab]."""
    tokens = list(prompt)
    for _ in range(NUM_DECODE):
        logits = hf(torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens, hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


def paged_steps(seqs: list[list[int]], prompt_lens, tables, run) -> list[torch.Tensor]:
    """Every sequence as one batch, prompts in chunks (CHUNK_SIZES) then a token a step:
    run(chunks, ids, positions) -> the step's logits [T, vocab]; logits per sequence."""
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        chunks, ids, pos, owners = [], [], [], []
        for i, seq in enumerate(seqs):
            if done[i] == len(seq):
                continue
            n = min(CHUNK_SIZES[i], prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
            chunks.append(SeqChunk(num_computed=done[i], num_new=n, block_table=tables[i]))
            ids += seq[done[i] : done[i] + n]
            pos += range(done[i], done[i] + n)
            owners.append((i, n))
        logits = run(chunks, torch.tensor(ids), torch.tensor(pos)).split([n for _, n in owners])
        for (i, n), lg in zip(owners, logits):
            out[i].append(lg)
            done[i] += n
    return [torch.cat(o) for o in out]


@torch.no_grad()
def _run_paged(
    model, config: ModelConfig, seqs: list[list[int]], prompt_lens
) -> list[torch.Tensor]:
    """Runs all sequences as one batch through the paged path; logits per sequence [len, vocab]."""
    needed = [math.ceil(len(s) / BLOCK_SIZE) for s in seqs]
    kv = make_kv_cache(config, sum(needed), BLOCK_SIZE)
    blocks = kv.allocator.allocate(sum(needed))
    assert len({kv.layout.locate(b)[0] for b in blocks}) > len(seqs)  # several pages each
    perm = [blocks[i] for i in torch.randperm(len(blocks)).tolist()]
    tables = [perm[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seqs))]

    def run(chunks, ids, pos):
        md = AttentionMetadata.build(chunks, BLOCK_SIZE, torch.device("cpu"))
        ctx = ForwardContext(attn=TorchPagedAttention(kv.layer_views, md))
        return model.compute_logits(model(ids, pos, ctx))  # [T, vocab]

    out = paged_steps(seqs, prompt_lens, tables, run)
    kv.allocator.free(blocks)
    kv.check_integrity()
    kv.close()
    return out


def parity_diffs(name: str) -> list[float]:
    """Max |ours - HF| over all positions, per sequence."""
    hf = _tiny_hf_model(name)
    config = ModelConfig.from_hf(hf.config)
    ours = get_model_class(config.hf_architecture)(config).eval()
    ours.load_weights(hf.state_dict().items())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    seqs, refs = zip(*(_hf_greedy(hf, p) for p in prompts))
    logits = _run_paged(ours, config, list(seqs), PROMPT_LENS)
    return [float((lg - ref).abs().max()) for lg, ref in zip(logits, refs)]


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_paged_logits_match_hf(name: str):
    diffs = parity_diffs(name)
    assert max(diffs) <= TOL, f"{name}: max abs logit diff per sequence {diffs}"


def test_gemma3_config_sliding_layers():
    config = ModelConfig.from_hf(_tiny_hf_model("gemma3").config)
    assert config.layer_types == ("sliding", "full", "sliding")
    assert config.sliding_window == 6 and config.rope_local_theta == 10_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.attn_scale == 24**-0.5


def test_legacy_config_dict_matches_v5_config():
    legacy = {  # transformers 4 config.json shape (Llama 3.2 1B)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "torch_dtype": "bfloat16",
    }
    from_dict = ModelConfig.from_hf(legacy)
    assert from_dict == ModelConfig.from_hf(tf.AutoConfig.for_model(**legacy))
    assert from_dict.rope_theta == 500000.0 and from_dict.rope_scaling["factor"] == 32.0
    assert from_dict.eos_token_ids == (128001, 128008, 128009)
    assert from_dict.kv_bytes_per_token() == 2 * 16 * 8 * 64 * 2


def test_gemma3_multimodal_dict_serves_text_model():
    cfg = {  # Gemma 3 4B config.json: a sparse text_config relying on class defaults
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "model_type": "gemma3_text",
            "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = ModelConfig.from_hf(cfg)
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("gemma3", 256, 4)
    assert config.layer_types[:6] == ("sliding",) * 5 + ("full",)
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.eos_token_ids == (1, 106) and config.tie_word_embeddings


def test_load_weights_rejects_unknown_and_missing():
    hf = _tiny_hf_model("qwen3")
    config = ModelConfig.from_hf(hf.config)
    state = hf.state_dict()
    with pytest.raises(ValueError, match="unknown"):
        get_model_class("Qwen3ForCausalLM")(config).load_weights(
            [("model.bogus.weight", state["lm_head.weight"])]
        )
    with pytest.raises(ValueError, match="missing.*k_proj"):
        get_model_class("Qwen3ForCausalLM")(config).load_weights(
            (k, v) for k, v in state.items() if "layers.1.self_attn.k_proj" not in k
        )
    with pytest.raises(ValueError, match="supported: Gemma3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
