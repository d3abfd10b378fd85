"""The prefix cache's block hashes, which the front end computes and both engines look up.

Block i of a prompt (its tokens [i * block_size, (i + 1) * block_size), full blocks only) hashes to
blake2b-128 of (the hash of block i - 1, or 16 zero bytes for block 0) + its tokens as little-endian
int32. The chain makes a block's hash name its whole prefix, so equal hashes mean equal prefixes
(docs/engine.md, "Prefix cache", says why 128 bits are enough). In the arena a hash is 4 int32 words:
its 16 bytes, the low u64 first.
"""

from __future__ import annotations

import hashlib

import numpy as np

HASH_WORDS = 4  # int32 words of one block hash in the arena


def block_hashes(tokens: np.ndarray | list[int], block_size: int) -> np.ndarray:
    """The chain hashes of the full blocks of `tokens`, as int32 words [n_full_blocks * HASH_WORDS]."""
    data = np.ascontiguousarray(tokens, dtype="<i4")
    n_full = data.size // block_size
    out = bytearray(16 * n_full)
    prev = bytes(16)
    for i in range(n_full):
        prev = hashlib.blake2b(
            prev + data[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        out[16 * i : 16 * (i + 1)] = prev
    return np.frombuffer(bytes(out), dtype="<i4")


def hash_values(words: np.ndarray) -> list[int]:
    """Arena words -> one 128-bit int per block (the low u64 is the little-endian first half)."""
    raw = np.ascontiguousarray(words, dtype="<i4").tobytes()
    return [int.from_bytes(raw[i : i + 16], "little") for i in range(0, len(raw), 16)]


def arena_words(prompt: np.ndarray | list[int], block_size: int) -> np.ndarray:
    """What a prompt takes in the arena: its tokens, then (block_size > 0) its block hashes."""
    tokens = np.ascontiguousarray(prompt, dtype="<i4")
    return np.concatenate([tokens, block_hashes(tokens, block_size)]) if block_size else tokens


def cache_table_size(num_blocks: int) -> int:
    """Entries of an engine's prefix cache table: the power of two at or above 2 * num_blocks."""
    return 1 << max(1, (2 * num_blocks - 1).bit_length())


def prompt_words(prompt_len: int, block_size: int) -> int:
    """Arena words of a prompt and its block hashes (none when block_size is 0: the cache is off)."""
    return prompt_len + (HASH_WORDS * (prompt_len // block_size) if block_size else 0)
