"""Model sources: `hf:<dir>`, `gguf:<file>`, `dummy:<preset>` or a named model, and their tokenizers.

Torch-free: the front end resolves its source and loads the tokenizer here, on a host that may
have no torch at all; model/loaders reads the weights (with torch) through the same resolution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from blink_appliance.model import registry
from blink_appliance.model.tokenizer import Tokenizer

SourceKind = Literal["hf", "gguf", "dummy", "named"]


def parse_source(source: str) -> tuple[SourceKind, str]:
    """The source's kind and its argument (directory, file, preset, or the model's name)."""
    kind, sep, arg = source.partition(":")
    if sep and kind in ("hf", "gguf", "dummy"):
        if not arg:
            raise ValueError(f"model source {source!r}: nothing after '{kind}:'")
        return kind, arg  # type: ignore[return-value]
    if registry.is_named(source):
        return "named", source
    raise ValueError(
        f"unknown model source {source!r}: expected hf:<dir>, gguf:<file>, dummy:<preset> "
        f"or a named model ({', '.join(registry.known_names())})"
    )


def hf_directory(arg: str) -> Path:
    directory = Path(arg)
    if not directory.is_dir():
        raise FileNotFoundError(f"hf: model directory not found: {directory}")
    return directory


def gguf_path(kind: SourceKind, arg: str) -> Path:
    """The GGUF file of a `gguf:` or named source; a named model is pulled first if not cached."""
    if kind == "named":
        return registry.resolve(arg)
    path = Path(arg)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def hf_tokenizer(directory: Path) -> Tokenizer | None:
    if not (directory / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_hf_dir(directory)


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer alone (for the front end), without reading weights. None for dummy models."""
    kind, arg = parse_source(source)
    if kind == "dummy":
        return None
    if kind == "hf":
        return hf_tokenizer(hf_directory(arg))
    return Tokenizer.from_gguf(gguf_path(kind, arg))
