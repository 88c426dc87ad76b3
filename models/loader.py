"""Load a model from an HF directory, a GGUF file, or a named preset with dummy weights.

    load_model(ModelSource.parse("/ckpt/Llama-3.1-8B"))           # config.json + safetensors
    load_model(ModelSource.parse("/models/x.Q4_K_M.gguf"), cache_root=...)  # converted once
    load_model(ModelSource.parse("dummy:llama-3.1-8b"), dtype=torch.bfloat16, device="cuda")
    load_model(ModelSource.parse("smollm2-135m"), cache_root=...)  # an embedded default (GGUF)

The model is built on the meta device and materialized once, in the target dtype on the target
device (an 8B model never exists in float32 or twice). Settings come in as arguments (this package
reads no environment): where GGUF conversions are cached, whether fused kernels are used.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from models.config import ModelConfig
from models.embedded import EMBEDDED_MODELS, resolve_source
from models.layers.causal_lm import CausalLM
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding
from models.presets import get_preset, list_presets
from models.registry import get_model_class
from models.safetensors_files import iter_safetensors, safetensors_files
from models.tokenizer import BOS, EOS, PAD, ByteTokenizer, load_tokenizer

SourceKind = Literal["hf", "gguf", "dummy"]
DUMMY_STD = 0.02
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from: an HF directory, a GGUF file, or a preset (dummy)."""

    kind: SourceKind
    path: str  # directory, .gguf file, or preset name

    def __post_init__(self) -> None:
        if self.kind not in ("hf", "gguf", "dummy"):
            raise ValueError(f"model source kind must be hf, gguf or dummy, got {self.kind!r}")

    @property
    def name(self) -> str:
        """A default served name: the preset, the file stem, or the directory name."""
        return self.path if self.kind == "dummy" else Path(self.path).stem

    @staticmethod
    def parse(spec: str) -> ModelSource:
        """ "dummy:<preset>" | an embedded model's name | a .gguf file | an HF directory."""
        if spec.startswith("dummy:"):
            preset = spec.removeprefix("dummy:")
            get_preset(preset)  # fail now, with the list of presets
            return ModelSource("dummy", preset)
        if spec in EMBEDDED_MODELS:
            return ModelSource("gguf", resolve_source(spec))
        path = Path(spec).expanduser()
        if path.is_dir():
            return ModelSource("hf", str(path))
        if path.is_file():
            with path.open("rb") as f:
                if f.read(4) == _GGUF_MAGIC:
                    return ModelSource("gguf", str(path))
            raise ValueError(f"{path} is neither a GGUF file nor an HF checkpoint directory")
        raise FileNotFoundError(
            f"model source {spec!r}: no such file or directory; expected an HF directory, a .gguf "
            f"file, an embedded model ({', '.join(EMBEDDED_MODELS)}) or dummy:<preset> "
            f"({', '.join(list_presets())})"
        )


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM  # eval mode, no grad, on the target device and dtype
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    name: str


def load_model(
    source: ModelSource | str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    cache_root: str | Path | None = None,
    place: Placement | None = None,
) -> LoadedModel:
    """Build the model of `source` with its weights and tokenizer. `seed` only affects dummy;
    `cache_root` (where GGUF conversions are cached) is needed for GGUF sources; `place`, when
    given, provides the parameters' storage (see Placement), else they are allocated on
    `device`."""
    if isinstance(source, str):
        source = ModelSource.parse(source)
    device = torch.device(device)
    if source.kind == "dummy":
        return _load_dummy(source.path, dtype, device, seed, place)
    path = model_dir(source, cache_root)
    config = _read_config(path)
    model = _empty_model(config, dtype, device, place)
    files = safetensors_files(path)
    model.load_weights(iter_safetensors(files, desc=f"loading {source.name}"))
    return LoadedModel(_finish(model), load_tokenizer(path), config, source.name)


def empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    place: Placement,
) -> CausalLM:
    """A model of `config` whose parameters are the tensors `place` gives, left as they are (a
    model moving to another device, its weights copied in from elsewhere)."""
    return _finish(_empty_model(config, dtype, torch.device(device), place))


@dataclass(frozen=True)
class LoadedShards:
    shards: list[CausalLM]  # one per device, each with its slice of the weights
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig  # the whole model's
    name: str


def load_shards(
    source: ModelSource | str,
    devices: list[torch.device],
    places: list[Placement],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cache_root: str | Path | None = None,
) -> LoadedShards:
    """The model of `source` split over `devices` (tensor parallelism), each shard's parameters
    in the storage its `places` entry gives. A checkpoint is read whole on the host, then each
    shard takes its slice; a dummy model's shards get dummy weights of their own (the whole
    model never exists: a 70B-shaped one need not fit the host)."""
    from models.tensor_parallel import copy_shard, shard_config

    if isinstance(source, str):
        source = ModelSource.parse(source)
    degree = len(devices)
    if source.kind == "dummy":
        whole = None
        config, tokenizer = _dummy(source.path)
    else:
        loaded = load_model(source, dtype, "cpu", cache_root=cache_root)
        whole, config, tokenizer = loaded.model, loaded.config, loaded.tokenizer
    scfg = shard_config(config, degree)
    shards = []
    for rank, (device, place) in enumerate(zip(devices, places)):
        shard = _empty_model(scfg, dtype, torch.device(device), place)
        if whole is None:
            init_dummy_weights(shard, seed * degree + rank)
        else:
            copy_shard(whole, shard, rank)
        shards.append(_finish(shard))
    return LoadedShards(shards, tokenizer, config, source.name)


def model_dir(source: ModelSource, cache_root: str | Path | None) -> Path:
    """The HF-style directory of a file source (a GGUF file is converted, once, under
    cache_root)."""
    if source.kind == "dummy":
        raise ValueError("dummy models have no directory")
    if source.kind != "gguf":
        return Path(source.path)
    if cache_root is None:
        raise ValueError(f"loading GGUF file {source.path} needs a cache_root for its conversion")
    from models.gguf_convert import convert_gguf

    return convert_gguf(source.path, cache_root)


def read_config(source: ModelSource, cache_root: str | Path | None) -> ModelConfig:
    """The model config of any source, reading nothing but config.json (or the preset)."""
    if source.kind == "dummy":
        return ModelConfig.from_hf(get_preset(source.path))
    return _read_config(model_dir(source, cache_root))


def _read_config(path: Path) -> ModelConfig:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (not an HF checkpoint directory)")
    try:
        return ModelConfig.from_hf(json.loads(file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: {e}") from e


# (name, shape, dtype) of every parameter (shared ones once) -> name -> an uninitialized tensor
# of that shape and dtype on the model's device, for the model to use as that parameter (e.g.
# views into one pooled weight buffer)
Placement = Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]]


def _empty_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, place: Placement | None = None
) -> CausalLM:
    """The model with uninitialized parameters of `dtype` on `device` (allocated once, or bound
    to the tensors `place` gives: built on meta, then assigned, with no change to model code)."""
    cls = get_model_class(config.hf_architecture)
    with torch.device("meta"):
        model = cls(config).to(dtype)
    first: dict[int, str] = {}  # id(parameter) -> its first name
    ties = []  # (name, name of the parameter it shares), e.g. lm_head.weight -> embed_tokens
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        first.setdefault(id(p), name)
    if place is None:
        model.to_empty(device=device)
    else:
        _bind(model, place, device)
    # NOTE: to_empty gives every module a fresh Parameter, which unties shared weights.
    for name, target in ties:
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(target))
    return model


def _bind(model: nn.Module, place: Placement, device: torch.device) -> None:
    params = list(model.named_parameters())  # shared ones once
    storage = place([(n, tuple(p.shape), p.dtype) for n, p in params])
    for name, p in params:
        t = storage[name]
        if t.shape != p.shape or t.dtype != p.dtype or t.device.type != device.type:
            raise ValueError(f"placement of {name}: {t.shape} {t.dtype} on {t.device}")
        module, _, attr = name.rpartition(".")
        model.get_submodule(module)._parameters[attr] = nn.Parameter(t, requires_grad=False)
    for m in model.modules():  # buffers (rope frequencies) are small: plain tensors
        for bname, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if isinstance(m, RotaryEmbedding):
            m._apply(lambda t: t)  # recomputes its frequencies on the device


def _finish(model: CausalLM) -> CausalLM:
    return model.eval().requires_grad_(False)


def _dummy(preset: str) -> tuple[ModelConfig, ByteTokenizer]:
    """A dummy model's config and tokenizer."""
    cfg = get_preset(preset)
    tokenizer = ByteTokenizer(cfg["vocab_size"])
    # The preset's token ids belong to its real tokenizer; dummy models speak ByteTokenizer's.
    cfg.update(
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    return ModelConfig.from_hf(cfg), tokenizer


def _load_dummy(
    preset: str, dtype: torch.dtype, device: torch.device, seed: int, place: Placement | None
) -> LoadedModel:
    config, tokenizer = _dummy(preset)
    model = _empty_model(config, dtype, device, place)
    init_dummy_weights(model, seed)
    return LoadedModel(_finish(model), tokenizer, config, preset)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Random N(0, std) weights in place, norms at identity (w = 1, or 0 for Gemma's (1 + w)).

    Each parameter draws from its own generator, seeded by (seed, name), so a parameter's values
    do not depend on the others' (same device kind and dtype -> same weights).
    """
    norms = {
        id(m.weight): 0.0 if m.unit_offset else 1.0
        for m in model.modules()
        if isinstance(m, RMSNorm)
    }
    params = list(model.named_parameters())
    for name, p in tqdm(params, desc="dummy weights", disable=True if len(params) < 100 else None):
        if id(p) in norms:
            p.fill_(norms[id(p)])
            continue
        gen = torch.Generator(device=p.device)
        gen.manual_seed(zlib.crc32(f"{seed}/{name}".encode()))  # CPU seeds use 32 bits
        p.normal_(0.0, std, generator=gen)
