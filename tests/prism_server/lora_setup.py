"""A tiny real base model on disk (an HF directory: random Llama weights, SmolLM2's tokenizer)
and LoRA adapters made for it with `peft`, for the engine and server tests of adapters; the
tokens each adapter's requests get from the model-level path (tests/models/lora_cases.greedy,
which tests/models/test_lora.py holds to HF + PEFT)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers as tf

from models.embedded import embedded_model_dir
from models.loader import ModelSource, load_model
from models.lora import NO_ADAPTER, LoraSlots, read_adapter
from prism_server import envs
from tests.models.lora_cases import Request, Spec, greedy, make_adapters

SPECS = {
    "sql": Spec(r=4, alpha=8, std=0.3),
    "chat": Spec(r=8, alpha=4, std=0.3, extra=(("use_rslora", True),)),
    "kv": Spec(r=2, alpha=2, std=0.4, targets=("k_proj", "v_proj")),
    "mlp": Spec(r=6, alpha=12, std=0.3, targets=("gate_proj", "up_proj", "down_proj")),
}
VOCAB = 49152  # SmolLM2's tokenizer


def tiny_base(root: Path, seed: int = 0, hidden: int = 64) -> tuple[Path, tf.PreTrainedModel]:
    """root/base: a tiny random Llama in the HF format with SmolLM2's tokenizer files."""
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    hf = tf.LlamaForCausalLM(cfg).eval()
    path = root / f"base-{hidden}"
    hf.save_pretrained(path)
    smol = embedded_model_dir("smollm2-135m", envs.gguf_cache_dir())
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smol / f).is_file():
            shutil.copy(smol / f, path / f)
    return path, hf


def make_set(root: Path) -> tuple[Path, dict[str, Path], tf.PreTrainedModel]:
    """The base's directory, the adapters' directories (SPECS), the HF model."""
    base, hf = tiny_base(root)
    dirs = make_adapters(hf, SPECS, root / "adapters-made")
    lora_dir = root / "lora"
    lora_dir.mkdir()
    for name, d in list(dirs.items()):
        dirs[name] = d.rename(lora_dir / name)
    return base, dirs, hf


def edited(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> Path:
    """A copy of adapter `src` with its config updated by `config`, file `drop` deleted."""
    shutil.copytree(src, dst)
    if config is not None:
        file = dst / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if drop is not None:
        (dst / drop).unlink()
    return dst


def solo_tokens(
    base: Path,
    dirs: dict[str, Path],
    prompts: dict[str | None, list[int]],
    n: int,
    quantization: str | None = None,
) -> dict[str | None, list[int]]:
    """Each prompt's greedy tokens alone through the model-level path, with its adapter (None:
    the base); quantization: the base's (models.quantization)."""
    ours = load_model(ModelSource("hf", str(base)), quantization=quantization).model
    names = [a for a in prompts if a is not None]
    slots = LoraSlots(ours, num_slots=max(len(names), 1))
    for i, name in enumerate(names):
        slots.assign(i, read_adapter(dirs[name], ours).weights)
    out = {}
    for a, prompt in prompts.items():
        slot = NO_ADAPTER if a is None else names.index(a)
        out[a] = greedy(ours, slots, [Request(prompt, slot)], n)[0][0]
    return out
