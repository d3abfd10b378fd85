"""Write a copy of a GGUF model that keeps only its first N decoder layers (real weights, smaller file).

    python3 bench/truncate_gguf.py IN.gguf OUT.gguf --layers 8

Why: the device tool carries at most 64 MiB of tree per call, and SmolLM2-135M's GGUF is 98 MB. Its
first 8 of 30 layers plus the (tied) embedding and final norm come to about 48 MB: enough to check the
GPU forward's bf16 error against the fp32 reference on trained weights rather than random ones.
Metadata and tokenizer are copied as they are, except `<arch>.block_count`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf


def truncate(src: Path, dst: Path, layers: int) -> int:
    """Copy src to dst with blocks >= `layers` dropped; returns the bytes of tensor data written."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    old_count = reader.fields[count_key].contents()
    if not 0 < layers <= old_count:
        raise ValueError(f"--layers must be in 1..{old_count}, got {layers}")
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer emits the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = layers if field.name == count_key else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors if not _block_index(t.name) >= layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return sum(int(t.n_bytes) for t in kept)


def _block_index(name: str) -> int:
    """The layer a tensor belongs to (blk.<i>.*), or -1 for the embedding, final norm and head."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    nbytes = truncate(args.src, args.dst, args.layers)
    print(f"{args.dst}: {args.layers} layers, {nbytes / 1e6:.1f} MB of tensors")


if __name__ == "__main__":
    main()
