"""A checkpoint's metadata without its weights: what `blink-appliance check` reads.

GGUF headers (the tensor table and the metadata keys, memory-mapped, no tensor data read),
safetensors headers (the 8-byte length and the JSON table before the data) and config.json. Enough to
build the ModelConfig, check every tensor the model needs is there with its shape and a supported
type, and count the bytes on disk, in well under a second even for a multi-GB checkpoint.
A named model is never pulled here: one that is not cached raises ModelNotCached.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from blink_appliance.model import registry
from blink_appliance.model.config import ModelConfig
from blink_appliance.model.gguf_file import field_value
from blink_appliance.model.presets import preset_config, weight_shapes
from blink_appliance.model.sources import gguf_path, hf_directory, parse_source

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_SAFETENSORS_HEADER = 100 * 1000 * 1000


class ModelNotCached(LookupError):
    """A named model that has not been pulled yet; `blink-appliance models pull NAME` fetches it."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"named model {name!r} is not in the local cache ({registry.cached_path(name)}); "
            f"`blink-appliance models pull {name}` fetches it (`up` pulls it too)"
        )
        self.name = name


@dataclass(frozen=True)
class CheckpointInfo:
    """What a source holds, read from headers only."""

    source: str
    files: tuple[Path, ...]  # the files read (none for dummy: presets)
    config: ModelConfig
    num_tensors: int
    file_bytes: int  # bytes of tensor data on disk (0 for random weights)
    tokenizer: str | None  # where the tokenizer comes from; None: the source has none

    def describe(self) -> str:
        where = ", ".join(str(f) for f in self.files) if self.files else "random weights, nothing on disk"
        c = self.config
        return (
            f"checkpoint {self.source}: {where}\n"
            f"  {c.arch}, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads "
            f"({c.num_kv_heads} kv), vocab {c.vocab_size}, context {c.max_position_embeddings}\n"
            f"  {self.num_tensors} tensors, {self.file_bytes / 2**20:.1f} MiB on disk; "
            f"tokenizer: {self.tokenizer or 'none (token-id prompts only)'}"
        )


def read_checkpoint_info(source: str) -> CheckpointInfo:
    """Headers of `source` checked against the model they describe. FileNotFoundError for a missing
    file, ValueError for one that does not hold a model we serve, ModelNotCached for a named model
    that is not pulled yet."""
    kind, arg = parse_source(source)
    if kind == "dummy":
        config = preset_config(arg)
        return CheckpointInfo(source, (), config, len(weight_shapes(config)), 0, None)
    if kind == "hf":
        return _hf_info(source, hf_directory(arg))
    if kind == "named" and not registry.is_cached(arg):
        raise ModelNotCached(arg)
    return _gguf_info(source, gguf_path(kind, arg))


def check_source_files(source: str) -> None:
    """The files `source` names exist (no header read, no torch): what `up` checks before it starts
    anything. A named model that is not cached passes: `up` pulls it."""
    kind, arg = parse_source(source)
    if kind == "hf":
        directory = hf_directory(arg)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"{directory / 'config.json'} not found (an hf: source needs config.json)"
            )
        if not any(directory.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors files in {directory}")
    elif kind == "gguf":
        gguf_path(kind, arg)


def _gguf_info(source: str, path: Path) -> CheckpointInfo:
    # gguf_loader carries the GGUF -> HF mapping; importing it reads no weights.
    from gguf import GGMLQuantizationType

    from blink_appliance.model.loaders.gguf_loader import SUPPORTED_QUANTS, config_from_gguf, hf_name

    try:
        reader = _HeaderReader(path, "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    config = config_from_gguf(reader)
    found: dict[str, tuple[int, ...]] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_QUANTS:
            raise ValueError(
                f"{path}: tensor {t.name!r} has quantization type {qtype}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_QUANTS)})"
            )
        name = hf_name(t.name)
        if name is None and t.name != "rope_freqs.weight":
            raise ValueError(f"{path}: tensor {t.name!r} is not one the {config.arch} model carries")
        if name is not None:
            found[name] = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml order is reversed
    _match_shapes(path, config, found)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return CheckpointInfo(source, (path,), config, len(found), file_bytes, _gguf_tokenizer(reader))


class _HeaderReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same fields and tensors, about 4x
    faster to open. The reader slices the file once per value (~250k times for a 49k-token vocabulary),
    and on np.memmap each slice pays the subclass's __array_finalize__; the view maps the same pages."""

    _plain: np.ndarray | None = None

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:  # GGUFReader._get's signature (gguf 0.19; tests open files through this)
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _gguf_tokenizer(reader: GGUFReader) -> str | None:
    model = field_value(reader, "tokenizer.ggml.model")
    return f"GGUF metadata ({model})" if model is not None else None


def _hf_info(source: str, directory: Path) -> CheckpointInfo:
    from blink_appliance.model.loaders.hf import config_from_hf

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (an hf: source needs config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    try:
        config = config_from_hf(raw)
    except KeyError as e:
        raise ValueError(f"{config_path}: key {e} is missing") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    found: dict[str, tuple[int, ...]] = {}
    file_bytes = 0
    for f in files:
        tensors, nbytes = safetensors_header(f)
        found.update((n, s) for n, s in tensors.items() if "rotary_emb" not in n)
        file_bytes += nbytes
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # the loader drops it too
    _match_shapes(directory, config, found)
    tokenizer = "tokenizer.json" if (directory / "tokenizer.json").is_file() else None
    return CheckpointInfo(source, (config_path, *files), config, len(found), file_bytes, tokenizer)


def safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """Each tensor's shape and the bytes of data the header promises, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_SAFETENSORS_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {length} of a {size}-byte file)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shapes[name] = tuple(int(d) for d in entry["shape"])
        end = max(end, int(entry["data_offsets"][1]))
    if 8 + length + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes, its header needs {8 + length + end})")
    return shapes, end


def _match_shapes(where: Path, config: ModelConfig, found: dict[str, tuple[int, ...]]) -> None:
    """Every parameter of the model present with its shape, and nothing else (as the loader requires)."""
    expected = weight_shapes(config)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where}: the tensors do not match the {config.arch} model: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(f"{where}: tensor {name} has shape {found[name]}, the model needs {shape}")


def _few(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"
