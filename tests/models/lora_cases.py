"""LoRA test cases: adapters made by `peft` on an HF model, PEFT's merged reference, and greedy
decoding of several requests in shared steps through Prism's paged path, each request with its
adapter slot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf
from peft import LoraConfig, PeftModel, get_peft_model

from models.attention.base import AttentionMetadata, ForwardContext, SeqChunk
from models.attention.torch_paged import TorchPagedAttention
from models.config import ModelConfig
from models.lora import (
    NO_ADAPTER,
    SUPPORTED_TARGETS,
    LoraModule,
    LoraShard,
    LoraSlots,
    LoraWeights,
    lora_targets,
)
from models.registry import get_model_class

ALL = list(SUPPORTED_TARGETS)
BLOCK = 16  # tokens a block of the test caches


def tiny_pair(
    seed: int = 0, hidden: int = 64, layers: int = 2
) -> tuple[tf.PreTrainedModel, torch.nn.Module]:
    """A tiny random HF Llama and Prism's model with the same weights."""
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    hf = tf.LlamaForCausalLM(cfg).eval()
    config = ModelConfig.from_hf(hf.config)
    ours = get_model_class(config.hf_architecture)(config).eval()
    ours.load_weights(hf.state_dict().items())
    return hf, ours.requires_grad_(False)


@dataclass(frozen=True)
class Spec:
    """An adapter to make: LoraConfig's arguments (B drawn N(0, std), A as PEFT draws it)."""

    r: int = 8
    alpha: float = 16
    targets: tuple[str, ...] = tuple(ALL)
    std: float = 0.02
    extra: tuple[tuple[str, object], ...] = ()  # more LoraConfig arguments

    def config(self) -> LoraConfig:
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            init_lora_weights=False,  # A random (B is drawn below)
            **dict(self.extra),
        )


@torch.no_grad()
def make_adapters(hf: tf.PreTrainedModel, specs: dict[str, Spec], root: Path) -> dict[str, Path]:
    """Each spec's adapter made by peft on `hf` and saved in the PEFT format under root/<name>
    (B random and non-zero); `hf` is left as it was (the adapters are unloaded)."""
    names = list(specs)
    gen = torch.Generator().manual_seed(1234)
    pm = get_peft_model(hf, specs[names[0]].config(), adapter_name=names[0])
    for name in names[1:]:
        pm.add_adapter(name, specs[name].config())
    for pname, p in pm.named_parameters():
        if ".lora_B." in pname:
            name = pname.split(".lora_B.")[1].split(".")[0]
            p.copy_(torch.randn(p.shape, generator=gen) * specs[name].std)
    dirs = {}
    for name in names:
        pm.save_pretrained(root / "made", selected_adapters=[name])
        made = root / "made" / name if (root / "made" / name).is_dir() else root / "made"
        dirs[name] = made.rename(root / name)
    pm.unload()
    return dirs


@torch.no_grad()
def merged_logits(hf: tf.PreTrainedModel, adapter: Path | None, seq: list[int]) -> torch.Tensor:
    """HF + PEFT's merge_and_unload logits along `seq` ([len, vocab]); `hf` restored after."""
    if adapter is None:
        return hf(torch.tensor([seq])).logits[0]
    saved = {k: v.clone() for k, v in hf.state_dict().items()}
    merged = PeftModel.from_pretrained(hf, adapter).merge_and_unload()
    logits = merged(torch.tensor([seq])).logits[0]
    hf.load_state_dict(saved)
    return logits


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    slot: int = NO_ADAPTER  # its adapter's slot
    start: int = 0  # the step at which it joins the batch


@torch.no_grad()
def greedy(
    model, slots: LoraSlots | None, requests: list[Request], new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The requests decoded greedily in shared steps through the torch paged backend: each
    prefills its prompt in one chunk at its start step, then a token a step. Returns each
    request's new tokens and logits [new_tokens, vocab]."""
    cfg = model.config
    lens = [len(r.prompt) + new_tokens for r in requests]
    per = [-(-n // BLOCK) for n in lens]
    caches = [
        torch.zeros(1 + sum(per), 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]
    tables, nxt = [], 1  # block 0: the null block
    for n in per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    out: list[list[int]] = [[] for _ in requests]
    logits: list[list[torch.Tensor]] = [[] for _ in requests]
    step = 0
    while any(len(o) < new_tokens for o in out):
        chunks, ids, pos, token_slots, owners = [], [], [], [], []
        for i, r in enumerate(requests):
            if r.start > step or len(out[i]) == new_tokens:
                continue
            seq = r.prompt + out[i]
            done = 0 if not out[i] else len(seq) - 1
            chunks.append(SeqChunk(done, len(seq) - done, tables[i]))
            ids += seq[done:]
            pos += range(done, len(seq))
            token_slots += [r.slot] * (len(seq) - done)
            owners.append(i)
        step += 1
        if not chunks:
            continue
        md = AttentionMetadata.build(chunks, BLOCK, torch.device("cpu"))
        lora = slots.batch(token_slots, torch.device("cpu")) if slots is not None else None
        ctx = ForwardContext(attn=TorchPagedAttention(caches, md), lora=lora)
        hidden = model(torch.tensor(ids), torch.tensor(pos), ctx)
        last = md.query_start_loc[1:].long() - 1
        step_logits = model.compute_logits(hidden[last])
        for i, lg in zip(owners, step_logits):
            out[i].append(int(lg.argmax()))
            logits[i].append(lg)
    return out, [torch.stack(lg) for lg in logits]


def random_weights(
    model: torch.nn.Module,
    rank_of: dict[str, int],
    gen: torch.Generator,
    std: float = 0.3,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoraWeights:
    """An adapter of N(0, std) entries on every projection of `model` whose HF name has a rank
    in `rank_of` (q_proj: 4, ...; absent or 0: left alone), its tensors on `device`."""
    by_module: dict[str, list] = {}
    for t in lora_targets(model).values():
        if rank_of.get(t.shard, 0):
            by_module.setdefault(t.module, []).append(t)
    modules = {}
    for name, ts in by_module.items():
        ranks = [rank_of[t.shard] for t in ts]
        a = torch.randn(sum(ranks), ts[0].in_features, generator=gen) * std
        shards, off = [], 0
        for t, r in zip(ts, ranks):
            b = torch.randn(t.out_features, r, generator=gen) * std
            shards.append(LoraShard(t.shard, t.rows, slice(off, off + r), b.to(dtype).to(device)))
            off += r
        modules[name] = LoraModule(a.to(dtype).to(device), tuple(shards))
    return LoraWeights(modules)
