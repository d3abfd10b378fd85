"""A counter-based random source: uniform(seed, output_index, vocab_index) in pure integer arithmetic.

No generator state is carried between steps, so a request's draws depend only on its seed, how many
tokens it has generated, and the vocabulary index; never on the batch around it, on preemption, or on
the device. The definition (docs/engine.md, "Random numbers") is splitmix64 used as a counter hash:

    mix(z)    = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
    key       = mix(seed      + (output_index + 1) * GAMMA)      # GAMMA = 0x9E3779B97F4A7C15
    bits      = mix(key       + (vocab_index  + 1) * GAMMA)
    u         = ((bits >> 41) + 0.5) * 2**-23                    # float32, exactly, in (0, 1)

all in unsigned 64-bit arithmetic (wrapping), `>>` a logical shift. torch has no uint64 arithmetic on
every backend, so this runs on int64 (two's complement wraps the same for +, *, ^) and masks the bits
an arithmetic right shift would smear in.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
# k + 0.5 for k < 2**23 needs 24 significant bits: exact in float32 on every device, and at most
# 1 - 2**-24. With 24 bits the top value rounded to exactly 1.0 (log u = 0: that token always won).
UNIFORM_BITS = 23


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned x."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GAMMA_S, _MIX1_S, _MIX2_S = _signed(GAMMA), _signed(MIX1), _signed(MIX2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes holding uint64 bits."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (bit-for-bit the uint64 function); consumes z."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1_S)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2_S)
    return z.bitwise_xor_(_shr(z, 31))


def row_keys(seeds: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """[R] int64 keys, one per (seed, output_index)."""
    return mix(seeds.to(torch.int64) + (output_index.to(torch.int64) + 1) * _GAMMA_S)


def _to_uniform(bits: torch.Tensor) -> torch.Tensor:
    return _shr(bits, 64 - UNIFORM_BITS).to(torch.float32).add_(0.5).mul_(2.0**-UNIFORM_BITS)


def uniforms(seeds: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] float32 uniforms in (0, 1) for rows (seeds[r], output_index[r])."""
    keys = row_keys(seeds, output_index)
    counter = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device).mul_(_GAMMA_S)
    return _to_uniform(mix(keys[:, None] + counter[None, :]))


def uniforms_at(keys: torch.Tensor, vocab_index: torch.Tensor) -> torch.Tensor:
    """Uniforms for single (key, vocab_index) pairs: the same numbers `uniforms` gives at those indices."""
    return _to_uniform(mix(keys + (vocab_index.to(torch.int64) + 1) * _GAMMA_S))


# A plain-Python rendering of the same definition, for tests and for checking GPU ports by hand.
def mix_int(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def uniform_int(seed: int, output_index: int, vocab_index: int) -> float:
    key = mix_int(seed + (output_index + 1) * GAMMA)
    bits = mix_int(key + (vocab_index + 1) * GAMMA)
    return ((bits >> (64 - UNIFORM_BITS)) + 0.5) * 2.0**-UNIFORM_BITS
