"""open_gguf's reader against the gguf package's own: the same fields, values and tensors."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from blink_appliance.model.gguf_file import field_value, open_gguf
from tests.gguf_helpers import write_gguf


def test_open_gguf_reads_what_the_stock_reader_reads(tmp_path):
    path = tmp_path / "m.gguf"
    many = [f"word{i}" * (1 + i % 3) for i in range(3000)]
    write_gguf(
        path, hidden=16, heads=2, kv_heads=1, head_dim=8, ff=32, layers=1,
        extra_kv={"test.many": ("array", many), "test.big": ("uint64", 2**40 + 7), "test.neg": ("int32", -5)},
    )  # fmt: skip
    stock, ours = GGUFReader(path, "r"), open_gguf(path)
    # The method it replaces is still the base's: otherwise the override would silently not apply.
    assert "_get" in vars(GGUFReader) and type(ours) is not GGUFReader
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types and mine.data == field.data and mine.offset == field.offset, name
        pairs = zip(mine.parts, field.parts, strict=True)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in pairs), name
        assert field_value(ours, name) == field_value(stock, name), name
    assert field_value(ours, "test.many") == many
    assert field_value(ours, "test.big") == 2**40 + 7 and field_value(ours, "test.neg") == -5
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in stock.tensors
    ]
    for a, b in zip(ours.tensors, stock.tensors, strict=True):
        assert (
            a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
        )
    assert ours.data_offset == stock.data_offset and ours.alignment == stock.alignment
