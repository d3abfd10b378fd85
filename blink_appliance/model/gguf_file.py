"""Opening a GGUF file and reading its metadata, without torch.

The `gguf` package's memory-mapped reader (numpy only): the tokenizer reads its vocabulary here,
and the weight loader (loaders/gguf_loader.py) its architecture and tensors.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader


@functools.cache
def _reader_class() -> type[GGUFReader]:
    import numpy as np
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        """The stock reader, its reads slicing a plain ndarray view of the file's memmap (the same
        pages, no copy). numpy.memmap runs Python hooks on every slice and the reader takes a few
        per string: SmolLM2's 98k tokenizer strings took 3.7 s to parse, 1.3 s this way, and the
        engine and the front end each parse them at start (tests/test_gguf_file.py compares the two)."""

        def _get(
            self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
        ) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(
                arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
            )

    return PlainViewReader


def open_gguf(path: str | Path) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _reader_class()(path, "r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar / str / list, or `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
