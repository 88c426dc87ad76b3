"""Shared pieces of the GPU tests: a tiny Llama with FlashInfer's head_dim, a pool on the device,
a greedy driver over ModelWorker, and comparisons that tell real divergence from near-ties."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from kvpool import CpuBackend, KVLayout, PagedKV, PagePool
from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.kernels.tuning import KernelConfig
from models.loader import init_dummy_weights
from models.registry import get_model_class
from models.tokenizer import ByteTokenizer
from prism_server.engine.model_runner import DeviceResources
from prism_server.engine.model_worker import ModelWorker
from prism_server.engine.worker_build import assemble_worker
from scheduler.batch_scheduler import SchedulerConfig
from scheduler.request import FinishReason, Request
from scheduler.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = [pytest.mark.gpu, needs_cuda]

BLOCK = 16
# 2 layers, GQA 4:2, head_dim 128 (a FlashInfer head size shared with Llama-3.1-8B's module).
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ids = itertools.count()


def tiny_model(seed: int = 0, **hf) -> tuple[ModelConfig, torch.nn.Module]:
    """The tiny Llama on the CPU in float32, with weights exactly representable in bf16; hf:
    config fields that change it (another architecture of the same shape)."""
    cfg = ModelConfig.from_hf(dict(TINY, **hf))
    with torch.device("meta"):
        model = get_model_class(cfg.hf_architecture)(cfg)
    model = model.to_empty(device="cpu").float()
    init_dummy_weights(model, seed, std=0.05)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return cfg, model.eval().requires_grad_(False)


def on_gpu(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)


def prompts(n: int, seed: int = 0, lengths=(5, 33, 70, 131)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(300, 1000, (lengths[i % len(lengths)] + i,), generator=g).tolist()
        for i in range(n)
    ]


def cuda_pool(pages: int, page_bytes: int = 2 << 20) -> PagePool:
    from kvpool import CudaBackend

    return PagePool(CudaBackend("cuda"), page_bytes, (pages + 1) * page_bytes, precreate=pages)


def model_engine(
    name: str,
    cfg: ModelConfig,
    model,
    pool: PagePool,
    *,
    graphs: bool = True,
    cached: int = 1,
    kernels: KernelConfig | None = None,
) -> ModelWorker:
    """kernels: the attention kernels of the model's own device resources (None: the defaults,
    with workspaces of its own); either way each step's tokens are read before the next
    (greedy records the logits `Sampler.sample` sees)."""
    sched = SchedulerConfig(
        block_size=BLOCK, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=2048
    )
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    res = DeviceResources(device, kernels, launch_ahead=False) if kernels is not None else None
    me = assemble_worker(
        name, model, ByteTokenizer(cfg.vocab_size), pool, sched, dtype, cached, resources=res
    )
    if not graphs and me.runner.graphs is not None:
        from prism_server.engine.model_runner import ModelRunner

        me.runner = ModelRunner(model, me.kv.cache, me.device, cuda_graph_sizes=())
    return me


def tiny_cpu_worker(name: str = "m") -> ModelWorker:
    """The tiny Llama served on the CPU, on a host pool of its own."""
    cfg, model = tiny_model()
    backend = CpuBackend()
    page = backend.round_up(1 << 20)
    return model_engine(name, cfg, model, PagePool(backend, page, 40 * page, precreate=8))


def start(
    me: ModelWorker,
    prompt_ids: list[list[int]],
    max_tokens: int,
    adapters: list[str | None] | None = None,
) -> list[Request]:
    """adapters: each prompt's LoRA adapter of the model (None: the model's own)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = []
    for i, p in enumerate(prompt_ids):
        errors: list[str] = []
        r = Request(f"r{next(_ids)}", list(p), params, frozenset(), 0.0)
        r.adapter = adapters[i] if adapters is not None else None
        r.sink = lambda out, errors=errors: errors.append(out.error) if out.error else None
        r.errors = errors
        me.add(r)
        reqs.append(r)
    return reqs


def greedy(
    me: ModelWorker,
    prompt_ids: list[list[int]],
    max_tokens: int,
    adapters: list[str | None] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Runs the prompts as one batch to completion (each with its adapter in `adapters`);
    returns each one's tokens and the logits [max_tokens, vocab] (float32, host) it sampled
    them from."""
    reqs = start(me, prompt_ids, max_tokens, adapters)
    log = {r.request_id: [] for r in reqs}
    sample = me.sampler.sample

    def recording(logits, rs):
        for i, r in enumerate(rs):
            if r.request_id in log:
                log[r.request_id].append(logits[i].float().cpu())
        return sample(logits, rs)

    me.sampler.sample = recording
    try:
        while me.has_work:
            me.step(0.0)
    finally:
        del me.sampler.sample
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH, (r.finish_reason, r.errors)
    return [r.output_token_ids for r in reqs], [torch.stack(log[r.request_id]) for r in reqs]


def cpu_kv(cfg: ModelConfig, name: str = "reference") -> PagedKV:
    """A float32 paged KV cache of 8 pages for cfg's model, on a host pool of its own."""
    backend = CpuBackend()
    page = backend.round_up(1 << 20)
    pool = PagePool(backend, page, 8 * page)
    gran = backend.granularity
    layout = KVLayout(
        cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, page, gran
    )
    return PagedKV(pool, name, layout, max_pages=8, max_cached_pages=0)


def cpu_logits(cfg: ModelConfig, model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), vocab] of the CPU model over one sequence (one prefill)."""
    kv = cpu_kv(cfg)
    blocks = kv.allocator.allocate(-(-len(tokens) // BLOCK))
    md = AttentionMetadata.build([SeqChunk(0, len(tokens), blocks)], BLOCK, torch.device("cpu"))
    with torch.inference_mode():
        ctx = ForwardContext(attn=TorchPagedAttention(kv.layer_views, md))
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), ctx)
        out = model.compute_logits(hidden)
    kv.allocator.free(blocks)
    kv.close()
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b agree on from the start (len(a) where they never differ)."""
    d = first_divergence(a, b)
    return len(a) if d is None else d


def assert_logits_close(
    ref_tokens: list[list[int]],
    ref_logits: list[torch.Tensor],
    tokens: list[list[int]],
    logits: list[torch.Tensor],
    bound: float,
) -> None:
    """Each sequence's logits within `bound` of the reference's (relative, by norm) up to its
    first divergent token."""
    for rt, t, rl, lg in zip(ref_tokens, tokens, ref_logits, logits):
        k = first_divergence(rt, t) or len(t)
        rel = (lg[:k] - rl[:k]).norm() / rl[:k].norm()
        assert rel < bound, float(rel)


def assert_no_real_divergence(
    ref_tokens: list[list[int]],
    ref_logits: list[torch.Tensor],
    got_tokens: list[list[int]],
    tie: float = 0.05,
) -> int:
    """Token lists must agree up to the first step where the reference itself had a near-tie:
    there the reference's logit of its own pick may beat the other pick by at most `tie` times its
    logit spread (max - median). Returns how many sequences agree fully."""
    same = 0
    for i, (ref, got) in enumerate(zip(ref_tokens, got_tokens)):
        k = first_divergence(ref, got)
        if k is None:
            same += 1
            continue
        lg = ref_logits[i][k]
        gap = float(lg[ref[k]] - lg[got[k]])
        spread = float(lg.max() - lg.median())
        assert gap <= tie * spread, (
            f"sequence {i} diverges at token {k} ({ref[k]} vs {got[k]}): the reference prefers its "
            f"token by {gap:.4f}, not a tie (spread {spread:.3f})"
        )
    return same
