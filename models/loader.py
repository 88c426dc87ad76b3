"""Load a model from an HF directory, a GGUF file, or a named preset with dummy weights.

    load_model(ModelSource.parse("/ckpt/Llama-3.1-8B"))           # config.json + safetensors
    load_model(ModelSource.parse("/models/x.Q4_K_M.gguf"), cache_root=...)  # converted once
    load_model(ModelSource.parse("dummy:llama-3.1-8b"), dtype=torch.bfloat16, device="cuda")
    load_model(ModelSource.parse("smollm2-135m"), cache_root=...)  # an embedded default (GGUF)
    load_model(..., quantization="fp8")  # projections in FP8 E4M3 (models.quantization)

The model is built on the meta device and materialized once, in the target dtype on the target
device (an 8B model never exists in float32 or twice). Settings come in as arguments (this package
reads no environment): where GGUF conversions are cached, whether fused kernels are used.
"""

from __future__ import annotations

import json
import logging
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
from models.layers.fp8_linear import Fp8Linear
from models.layers.rms_norm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding
from models.presets import get_preset, list_presets
from models.quantization import (
    check_quantization,
    checkpoint_block,
    checkpoint_fp8,
    per_channel,
    quantize_fp8,
    quantize_model,
)
from models.registry import get_model_class
from models.safetensors_files import iter_safetensors, safetensors_files
from models.tokenizer import BOS, EOS, PAD, ByteTokenizer, load_tokenizer

SourceKind = Literal["hf", "gguf", "dummy"]
DUMMY_STD = 0.02
_GGUF_MAGIC = b"GGUF"

log = logging.getLogger(__name__)


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
    quantization: str | None = None,
) -> LoadedModel:
    """Build the model of `source` with its weights and tokenizer. `seed` only affects dummy;
    `cache_root` (where GGUF conversions are cached) is needed for GGUF sources; `place`, when
    given, provides the parameters' storage (see Placement), else they are allocated on
    `device`. quantization "fp8": the projections' weights in FP8 E4M3 with per-channel scales
    (quantized here, or as a checkpoint in FP8 holds them); `dtype` stays the compute dtype."""
    check_quantization(quantization)
    if isinstance(source, str):
        source = ModelSource.parse(source)
    device = torch.device(device)
    if source.kind == "dummy":
        return _load_dummy(source.path, dtype, device, seed, place, quantization)
    path = model_dir(source, cache_root)
    hf_config = _read_hf_config(path)
    config = _parse_config(path, hf_config)
    try:
        fp8_checkpoint = checkpoint_fp8(hf_config)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
    if fp8_checkpoint and quantization is None:
        raise ValueError(
            f"{path} holds FP8 weights (config.json's quantization_config): serve it with "
            "quantization = 'fp8'"
        )
    model = _empty_model(config, dtype, device, place, quantization)
    weights = iter_safetensors(safetensors_files(path), desc=f"loading {source.name}")
    block = checkpoint_block(hf_config) if fp8_checkpoint else None
    if block is not None:
        log.info("%s: FP8 weights in blocks of %s, requantized with a scale a row", path, block)
    model.load_weights(weights if block is None else per_channel(weights, block))
    return LoadedModel(_finish(model), load_tokenizer(path), config, source.name)


def empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    place: Placement,
    quantization: str | None = None,
) -> CausalLM:
    """A model of `config` whose parameters are the tensors `place` gives, left as they are (a
    model moving to another device, its weights copied in from elsewhere)."""
    check_quantization(quantization)
    return _finish(_empty_model(config, dtype, torch.device(device), place, quantization))


def meta_model(
    config: ModelConfig, dtype: torch.dtype, quantization: str | None = None
) -> CausalLM:
    """The model of `config` on the meta device (no memory): its parameters' names, shapes and
    dtypes as a load would place them (FP8 projections and their scales with "fp8")."""
    check_quantization(quantization)
    cls = get_model_class(config.hf_architecture)
    with torch.device("meta"):
        model = cls(config).to(dtype)
        return quantize_model(model) if quantization else model


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
    quantization: str | None = None,
) -> LoadedShards:
    """The model of `source` split over `devices` (tensor parallelism), each shard's parameters
    in the storage its `places` entry gives. A checkpoint is read whole on the host, then each
    shard takes its slice; a dummy model's shards get dummy weights of their own (the whole
    model never exists: a 70B-shaped one need not fit the host)."""
    from models.tensor_parallel import copy_shard, shard_config

    if quantization is not None:
        raise ValueError("FP8 weights are not split over devices (tensor parallelism)")
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
    return _parse_config(path, _read_hf_config(path))


def _read_hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (not an HF checkpoint directory)")
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def _parse_config(path: Path, hf_config: dict) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e


# (name, shape, dtype) of every parameter (shared ones once) -> name -> an uninitialized tensor
# of that shape and dtype on the model's device, for the model to use as that parameter (e.g.
# views into one pooled weight buffer)
Placement = Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], dict[str, torch.Tensor]]


def _empty_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    place: Placement | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """The model with uninitialized parameters of `dtype` on `device` (allocated once, or bound
    to the tensors `place` gives: built on meta, then assigned, with no change to model code).
    quantization "fp8": its projections are Fp8Linear (FP8 weights, float32 scales)."""
    model = meta_model(config, dtype, quantization)
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
    preset: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    place: Placement | None,
    quantization: str | None = None,
) -> LoadedModel:
    config, tokenizer = _dummy(preset)
    model = _empty_model(config, dtype, device, place, quantization)
    init_dummy_weights(model, seed)
    return LoadedModel(_finish(model), tokenizer, config, preset)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Random N(0, std) weights in place, norms at identity (w = 1, or 0 for Gemma's (1 + w)).

    Each parameter draws from its own generator, seeded by (seed, name), so a parameter's values
    do not depend on the others' (same device kind and dtype -> same weights). An FP8 weight
    draws in its layer's compute dtype and is quantized (its scale with it): an FP8 model is
    its unquantized twin's weights quantized.
    """
    norms = {
        id(m.weight): 0.0 if m.unit_offset else 1.0
        for m in model.modules()
        if isinstance(m, RMSNorm)
    }
    fp8 = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    scales = {id(m.weight_scale) for m in fp8.values()}
    params = list(model.named_parameters())
    for name, p in tqdm(params, desc="dummy weights", disable=True if len(params) < 100 else None):
        if id(p) in norms:
            p.fill_(norms[id(p)])
            continue
        if id(p) in scales:  # made with its weight
            continue
        gen = torch.Generator(device=p.device)
        gen.manual_seed(zlib.crc32(f"{seed}/{name}".encode()))  # CPU seeds use 32 bits
        if id(p) in fp8:
            layer = fp8[id(p)]
            w = torch.empty(p.shape, dtype=layer.compute_dtype, device=p.device)
            q, scale = quantize_fp8(w.normal_(0.0, std, generator=gen))
            p.copy_(q)
            layer.weight_scale.copy_(scale)
            continue
        p.normal_(0.0, std, generator=gen)
