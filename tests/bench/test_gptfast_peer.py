"""The decode-speed peer (scripts/bench_peer.py) is a whole Llama, not a cheaper model:
loaded with a small transformers Llama's weights, its prefill and its decode steps through the
static cache give transformers' logits and greedy tokens (on CPU, eager: the GPU run compiles
the same code)."""

import pytest
import torch
import transformers as tf

from scripts.bench_peer import PeerArgs, Transformer, decode_one_token, random_model


def _hf_llama():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attn_implementation="eager",
    )
    return tf.LlamaForCausalLM(cfg).eval(), cfg


def _peer_from(hf, cfg) -> Transformer:
    """transformers' weights in the peer's layout: q and k rows back to Meta's interleaved
    rope pairs (what gpt-fast's checkpoint conversion does), q/k/v in one wqkv."""
    a = PeerArgs(
        dim=cfg.hidden_size,
        n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads,
        n_local_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rope_base=500000.0,
        norm_eps=cfg.rms_norm_eps,
    )
    peer = Transformer(a).eval()
    hd = a.head_dim

    def interleave(w, heads):
        return w.view(heads, 2, hd // 2, a.dim).transpose(1, 2).reshape(heads * hd, a.dim)

    m = hf.model
    with torch.no_grad():
        peer.tok_embeddings.weight.copy_(m.embed_tokens.weight)
        peer.norm.weight.copy_(m.norm.weight)
        peer.output.weight.copy_(hf.lm_head.weight)
        for src, dst in zip(m.layers, peer.layers, strict=True):
            at = src.self_attn
            q = interleave(at.q_proj.weight, a.n_head)
            k = interleave(at.k_proj.weight, a.n_local_heads)
            dst.attention.wqkv.weight.copy_(torch.cat([q, k, at.v_proj.weight]))
            dst.attention.wo.weight.copy_(at.o_proj.weight)
            dst.feed_forward.w1.weight.copy_(src.mlp.gate_proj.weight)
            dst.feed_forward.w3.weight.copy_(src.mlp.up_proj.weight)
            dst.feed_forward.w2.weight.copy_(src.mlp.down_proj.weight)
            dst.attention_norm.weight.copy_(src.input_layernorm.weight)
            dst.ffn_norm.weight.copy_(src.post_attention_layernorm.weight)
    return peer


@torch.no_grad()
@pytest.mark.slow
def test_peer_matches_transformers_llama():
    hf, cfg = _hf_llama()
    peer = _peer_from(hf, cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, 11))
    peer.setup_caches(2, 11 + 6)
    assert peer.max_len == 24  # rounded up to 8s
    logits = peer(prompt, torch.arange(11))
    want = hf(prompt).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # decode: one token at a time through the static cache; each step's logits are
    # transformers' over the whole sequence so far, and its token their argmax
    x = torch.argmax(logits[:, -1], -1, keepdim=True).to(torch.int)
    seq = torch.cat([prompt, x], 1)
    for i in range(5):
        step = peer(x, torch.tensor([11 + i]))[:, -1]
        torch.testing.assert_close(step, hf(seq).logits[:, -1], rtol=1e-4, atol=1e-4)
        x = decode_one_token(peer, x, torch.tensor([11 + i]))  # the same position again
        assert torch.equal(x[:, 0], torch.argmax(step, -1).to(torch.int))
        seq = torch.cat([seq, x], 1)


def test_random_model_is_the_shape_asked():
    a = PeerArgs(dim=64, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=96, vocab_size=96)
    model = random_model(a, torch.device("cpu"), torch.float32)
    n = sum(p.numel() for p in model.parameters())
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96 + 2 * 64
    assert n == 2 * 96 * 64 + 2 * per_layer + 64
    assert all(p.isfinite().all() for p in model.parameters())
    assert model.layers[0].attention_norm.weight.eq(1).all()
