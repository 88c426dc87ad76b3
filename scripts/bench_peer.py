"""The peer for decode speed: a gpt-fast-style Llama decode, measured on the machine Prism's was.

gpt-fast (pytorch-labs) is the reference for "plain PyTorch, compiled": a Llama in ~200 lines,
a static K/V cache of `[batch, kv heads, max positions, head_dim]` written with an index copy,
attention by `scaled_dot_product_attention` over the whole cache under a mask, the one-token
step compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)` (Inductor's fused
kernels, replayed as a CUDA graph) and Inductor's coordinate-descent tuning on. This file
rebuilds that model and loop (its interleaved rope, its fused wqkv, its three-GEMM MLP, its
fp32 RMSNorm) so that its TPOT is measured right after Prism's on the same card.

Llama-3.1-8B's shape, bf16, random weights; for each batch of `--batches`, the cache holds
`--context` positions (filled at random: decode reads them as it would a prompt's), then
`--tokens` steps, greedy (argmax: cheaper than gpt-fast's default top-k sampling, so the figure
flatters the peer, not Prism); TPOT is the mean over the steps after the first two, the
lower of two runs (again in the peer's favour).

    python3 scripts/bench_peer.py [--batches "1 16"] [--context 1024] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass
class PeerArgs:
    """The model's shape (Llama-3.1-8B's by default)."""

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = 8
    intermediate_size: int = 14336
    vocab_size: int = 128256
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, batch: int, max_len: int, heads: int, head_dim: int, dtype):
        super().__init__()
        shape = (batch, heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_table(seq_len: int, n_elem: int, base: float, dtype=torch.bfloat16):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    freqs = torch.outer(torch.arange(seq_len, device=freqs.device), freqs)
    cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([cis.real, cis.imag], dim=-1).to(dtype)


def apply_rope(x, freqs_cis):
    """x: [B, S, H, D] with its pairs interleaved (Meta's layout); freqs_cis: [S, D/2, 2]."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack(
        [
            xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
            xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1],
        ],
        -1,
    )
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: PeerArgs):
        super().__init__()
        kv = a.n_local_heads * a.head_dim
        self.a = a
        self.wqkv = nn.Linear(a.dim, a.dim + 2 * kv, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, freqs_cis, mask, input_pos):
        a = self.a
        b, s, _ = x.shape
        kv = a.n_local_heads * a.head_dim
        q, k, v = self.wqkv(x).split([a.dim, kv, kv], dim=-1)
        q = q.view(b, s, a.n_head, a.head_dim)
        k = k.view(b, s, a.n_local_heads, a.head_dim)
        v = v.view(b, s, a.n_local_heads, a.head_dim)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        v = v.repeat_interleave(a.n_head // a.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, a.dim))


class FeedForward(nn.Module):
    def __init__(self, a: PeerArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: PeerArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: PeerArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_len = -1

    def setup_caches(self, batch: int, max_len: int) -> None:
        """The static caches, the rope table and the causal mask for `max_len` positions
        (rounded up to a multiple of 8, as gpt-fast does)."""
        a, p = self.a, self.output.weight
        max_len = -(-max_len // 8) * 8
        self.max_len = max_len
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(
                batch, max_len, a.n_local_heads, a.head_dim, p.dtype
            ).to(p.device)
        self.freqs_cis = rope_table(max_len, a.head_dim, a.rope_base, p.dtype).to(p.device)
        self.causal_mask = torch.tril(
            torch.ones(max_len, max_len, dtype=torch.bool, device=p.device)
        )

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def decode_one_token(model: Transformer, x, input_pos):
    """One step: the next token of each row, greedy."""
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int)


def random_model(a: PeerArgs, device, dtype=torch.bfloat16) -> Transformer:
    """The model with random weights, made on the device (no host copy of 16 GB)."""
    with torch.device("meta"):
        model = Transformer(a)
    model = model.to_empty(device=device).to(dtype)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02)
    return model.eval()


def fill_caches(model: Transformer, batch: int, context: int, tokens: int) -> None:
    """The static caches for `batch` rows of `context + tokens` positions, filled at random
    (the prompt's K/V as decode reads it)."""
    model.setup_caches(batch, context + tokens)
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.normal_()
        layer.attention.kv_cache.v_cache.normal_()


def tpot_ms(model: Transformer, step, context: int, tokens: int) -> float:
    """Mean time (ms) of a step after the first two, `tokens` steps from position `context`
    (gpt-fast's loop: the position advanced in place, each token cloned out of the graph)."""
    dev = model.output.weight.device
    batch = model.layers[0].attention.kv_cache.k_cache.shape[0]
    x = torch.randint(0, model.a.vocab_size, (batch, 1), device=dev, dtype=torch.int)
    pos = torch.tensor([context], device=dev, dtype=torch.int)
    t0 = 0.0
    for i in range(tokens):
        if i == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = step(model, x, pos).clone()
        pos += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (tokens - 2) * 1e3


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1 16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch._inductor.config as inductor

    # gpt-fast's settings
    inductor.coordinate_descent_tuning = True
    inductor.triton.unique_kernel_names = True
    inductor.fx_graph_cache = True
    from scripts.bench_kernels import gpu_start

    dev = torch.device("cuda")
    out: dict = {**gpu_start(dev), "peer": "gpt-fast-style, torch.compile reduce-overhead"}
    a = PeerArgs()
    model = random_model(a, dev)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    out["weight_bytes"] = weights
    out["floor_ms"] = weights / out["hbm_gbs"] / 1e6
    print(f"weights {weights / 2**30:.1f} GiB: floor {out['floor_ms']:.2f} ms a step")
    for b in (int(x) for x in args.batches.split()):
        fill_caches(model, b, args.context, args.tokens)
        t0 = time.perf_counter()
        tpot_ms(model, step, args.context, 4)  # compile and record the graph
        built = time.perf_counter() - t0
        tpot = min(tpot_ms(model, step, args.context, args.tokens) for _ in range(2))
        out[f"decode_b{b}"] = {"tpot_ms": tpot, "compile_s": built}
        print(
            f"gpt-fast-style B={b} ctx {args.context}: TPOT {tpot:.2f} ms (compile {built:.0f} s)"
        )
        if args.json:  # after every batch: a killed run keeps what it got
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
