"""GGUF file -> cached HF-style directory (config.json, tokenizer, float32 safetensors).

Converting is slow (Gemma-3-270M: ~40 s, half of it `gguf.GGUFReader` parsing the 262k-token
vocabulary, ~6 s dequantizing; SmolLM2-135M: ~11 s), so the result is cached under
`$PRISM_CACHE_DIR/gguf/<stem>-<key>`, the key hashing the file's absolute path, size and mtime
(and the converter version). A directory is built under a temporary name and renamed into place
when complete, so an interrupted conversion is never reused. The result loads as an HF checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from models.gguf_tensors import GGUF_ARCHS, MODEL_TYPE_ARCHS, GgufTensorMap

CONVERTER_VERSION = 2  # bump when the output changes, so stale caches are rebuilt
SHARD_BYTES = 2 << 30  # float32 bytes per safetensors shard
STALE_TEMP_S = 3600.0  # a conversion temp dir untouched this long belongs to a dead process
_INFO_FILE = "prism_gguf.json"


def gguf_cache_dir(path: str | Path, cache_root: str | Path) -> Path:
    """Where the conversion of GGUF file `path` is (or will be) cached."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(cache_root) / f"{p.stem}-{digest}"


def convert_gguf(path: str | Path, cache_root: str | Path) -> Path:
    """Convert GGUF file `path` to an HF-style directory cached under `cache_root`; returns the
    directory."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    out = gguf_cache_dir(path, cache_root)
    if (out / _INFO_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        reader = _open(path)
        with _shared_reader(path, reader):
            _write_config(path, tmp)
            _write_tokenizer(path, tmp, reader)
        _write_weights(reader, tmp)
        info = {"source": str(path.resolve()), "converter_version": CONVERTER_VERSION}
        (tmp / _INFO_FILE).write_text(json.dumps(info, indent=2))
        _make_readable(tmp)
        if out.exists():  # incomplete (no info file): not ours to keep
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:  # a concurrent conversion won the race; use its result
            if not (out / _INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _remove_stale_temps(out: Path) -> None:
    """Remove temp dirs of conversions that died without cleaning up (killed processes)."""
    for tmp in out.parent.glob(f".{out.name}.*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp makes 0700 directories (safetensors 0600 files); the cache is world-readable."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def gguf_state_dict(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of a GGUF file, dequantized on the fly."""
    reader = _open(Path(path))
    yield from _tensors(reader)


def _open(path: Path) -> gguf.GGUFReader:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHS))})"
        )
    return reader


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor_map(reader: gguf.GGUFReader) -> GgufTensorMap:
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    return GgufTensorMap(arch, heads, _field(reader, f"{arch}.attention.head_count_kv", heads))


def _tensors(reader: gguf.GGUFReader) -> Iterator[tuple[str, torch.Tensor]]:
    tmap = _tensor_map(reader)
    for t in tqdm(
        reader.tensors, desc=f"dequantizing {Path(reader.data.filename).name}", disable=None
    ):
        name = tmap.hf_name(t.name)
        if name is None:
            continue
        # numpy shape == reversed GGUF shape == torch [out_features, in_features]
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        data = np.require(tmap.to_hf(t.name, data), np.float32, ["C", "W"])
        yield name, torch.from_numpy(data)


@contextlib.contextmanager
def _shared_reader(path: Path, reader: gguf.GGUFReader) -> Iterator[None]:
    """Let transformers' GGUF config/tokenizer loaders reuse our already-parsed reader.

    NOTE: `gguf.GGUFReader.__init__` parses every metadata array element by element (~20 s for a
    262k-token vocabulary), and AutoConfig and AutoTokenizer each build their own. transformers
    imports the class from `gguf` at call time, so swapping the module attribute for the duration
    of the conversion parses the file once instead of three times.
    """
    original, resolved = gguf.GGUFReader, path.resolve()

    def reuse(p, *args, **kwargs):
        if not args and not kwargs and Path(p).resolve() == resolved:
            return reader
        return original(p, *args, **kwargs)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _write_config(path: Path, out: Path) -> None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises anything from KeyError to OSError here
        raise ValueError(f"{path}: cannot build a config from the GGUF metadata: {e!r}") from e
    arch = MODEL_TYPE_ARCHS.get(config.model_type)
    if arch is None:
        raise ValueError(f"{path}: model type {config.model_type!r} is not supported")
    config.architectures = [arch]
    config.save_pretrained(out)


# llama.cpp's token types: CONTROL marks the chat and format markers (<start_of_turn>, <unused0>)
_CONTROL = 3
# markers that GGUF files type as user-defined although the model's own tokenizer marks them
# special (Gemma 3's image markers): typed so, they would show up in text
_MARKERS = frozenset({"<start_of_image>", "<end_of_image>", "<image_soft_token>"})


def _special_tokens(reader: gguf.GGUFReader) -> list[str]:
    """The tokens the GGUF marks as control tokens, plus the known markers it has."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        return []
    names = (bytes(tokens.parts[i]).decode("utf-8", "replace") for i in tokens.data)
    kinds = (int(types.parts[i][0]) for i in types.data)
    return [n for n, k in zip(names, kinds) if k == _CONTROL or n in _MARKERS]


def _write_tokenizer(path: Path, out: Path, reader: gguf.GGUFReader) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # as above
        raise ValueError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e!r}") from e
    # transformers' GGUF import leaves control tokens ordinary, so skip_special_tokens would keep
    # them in text: mark them special (same ids, the vocabulary does not grow)
    size, vocab, known = len(tokenizer), tokenizer.get_vocab(), set(tokenizer.all_special_tokens)
    extra = [t for t in _special_tokens(reader) if t in vocab and t not in known]
    if extra:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": extra}, replace_extra_special_tokens=False
        )
        assert len(tokenizer) == size, "marking tokens special must not add any"
    tokenizer.save_pretrained(out)


def _write_weights(reader: gguf.GGUFReader, out: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + an index past SHARD_BYTES."""
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []  # names per written shard
    total = 0
    for name, tensor in _tensors(reader):
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            shard_names.append(_save_shard(shard, out, len(shard_names)))
        shard[name] = tensor
        total += tensor.nbytes
    if not shard_names:
        save_file(shard, out / "model.safetensors", metadata={"format": "pt"})
        return
    shard_names.append(_save_shard(shard, out, len(shard_names)))
    n, weight_map = len(shard_names), {}
    for i, names in enumerate(shard_names):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.rename(out / f"shard-{i}.tmp", out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_shard(tensors: dict[str, torch.Tensor], out: Path, i: int) -> list[str]:
    """Write and drop one shard (bounds memory for big files); returns its tensor names."""
    save_file(tensors, out / f"shard-{i}.tmp", metadata={"format": "pt"})
    names = list(tensors)
    tensors.clear()
    return names
