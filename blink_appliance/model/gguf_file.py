"""Opening a GGUF file and reading its metadata, without torch.

The `gguf` package's memory-mapped reader (numpy only): the tokenizer reads its vocabulary here,
and the weight loader (loaders/gguf_loader.py) its architecture and tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader


def open_gguf(path: str | Path) -> GGUFReader:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar / str / list, or `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
