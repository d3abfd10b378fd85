"""Triton kernels of the device sampler (blink_appliance/engine/loop/sampler.py).

The pieces the variants share (kernels/sampling_rejection.py and the modules beside it compose
them): the variants' indices (SAMPLER_*), x = logits / temperature rounded as torch rounds it
(`scaled`), and the exponential race (Gumbel-max) score of a token (`gumbel`). A chunk's best
(`best_score`) is screened with a cheap score and exact: only the tokens the screen cannot tell
apart get their exact scores. Ties go to the lowest index throughout.

The uniforms are engine/reference/rng.py's splitmix64 counter hash on uint64 lanes (wrapping multiply, logical
shift), bit-for-bit the CPU definition.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

GAMMA = tl.constexpr(0x9E3779B97F4A7C15)  # engine/reference/rng.py
# The sampler variants (the loop's sampler SWITCH), ordered by what they serve: each serves every row
# a smaller one serves, so schedule takes the largest any row needs. engine/loop/sampler.py has them.
SAMPLER_GREEDY = 0  # argmax rows only
SAMPLER_REJECTION = 1  # temperature, top-p, min-p (kernels/sampling_rejection.py)
SAMPLER_REJECTION_TOP_K = 2  # and rows with top-k but not top-p (its count and cut compiled in)
SAMPLER_REJECTION_TOP_K_TOP_P = 3  # and rows with both (the select of the top-k set compiled in too)
# Added to the variant when a row of the step asks for logprobs: the variant, then the logprob rows
# (engine/loop/logprobs.py), so steps without them pay nothing.
SAMPLER_LOGPROBS = 4
# Added when a row of the step has a penalty or a logit bias: the penalties first (they change the
# logits the variant and the logprobs read; engine/loop/penalties.py).
SAMPLER_PENALTIES = 8
# Added when the step scores prompt positions (prompt logprobs): their logits and logprob rows first
# (engine/loop/logprobs.py DevicePromptLogprobs), apart from the sample rows.
SAMPLER_SCORE = 16
assert (
    SAMPLER_REJECTION_TOP_K_TOP_P < SAMPLER_LOGPROBS
    and SAMPLER_PENALTIES == 2 * SAMPLER_LOGPROBS
    and SAMPLER_SCORE == 4 * SAMPLER_LOGPROBS
)  # the parts combine as bits


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    # libdevice's logf is what torch's CUDA log calls; the interpreter has no libdevice.
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _mass_term(raw, t, ref):
    """exp(x - ref) for x = raw / t, as every nucleus mass sums it (sampling_rejection.py MASS_PRECISION)."""
    return tl.exp(raw * (1.0 / t) - ref)


@triton.jit
def _min_p_floor(row_max, min_p, PRECISE: tl.constexpr):
    """min-p keeps x >= max + log(min_p) (log 0 = -inf keeps all)."""
    return tl.where(min_p > 0.0, row_max + _log(tl.maximum(min_p, 1e-38), PRECISE), float("-inf"))


# The race screens each chunk with a cheap score (MUFU's log) and computes the exact one only where
# the screen cannot tell: the cheap one is within 5e-5 of it (measured bound of the approximations
# below, plus 2^-22 of |score| for x * (1/t)), and the window is 40x that. The interpreter's screen
# is exact plus a deterministic offset of up to 0.45 of a wider window, so CPU tests exercise both
# outcomes of the screen.
SCREEN_WINDOW = tl.constexpr(2.0**-14)
SCREEN_WINDOW_INTERPRETED = tl.constexpr(2.0**-5)


@triton.jit
def scaled(raw, t, PRECISE: tl.constexpr):
    """logits / temperature, rounded as torch and the reference round it (IEEE division)."""
    if PRECISE:
        return libdevice.div_rn(raw, t)
    else:
        return raw / t


@triton.jit
def _race_bits(idx, seed, out_index):
    """The 23 bits of the counter hash of (seed, output index, token) that make the race's uniform, as
    int32 (a 64-bit integer's conversion to float takes several instructions)."""
    key = _mix(seed.to(tl.uint64) + (out_index.to(tl.uint64) + 1) * GAMMA)
    return (_mix(key + (idx.to(tl.uint64) + 1) * GAMMA) >> 41).to(tl.int32)


@triton.jit
def gumbel(x, idx, seed, out_index, PRECISE: tl.constexpr):
    """The race's score x - log(-log(u)), u the counter hash of (seed, output index, token): the
    definition, bit for bit the reference's (engine/reference/sampler.py)."""
    u = (_race_bits(idx, seed, out_index).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return x - _log(-_log(u, PRECISE), PRECISE)


@triton.jit
def _screen_gumbel(m, PRECISE: tl.constexpr):
    """-log(-log(u)) for u = (m + 0.5) / 2^23, cheaply: MUFU's log, with -log(u) by its series where u
    is within 2^-7 of 1 (there MUFU's absolute error would be large against -log(u) itself)."""
    u = (m.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if PRECISE:
        v = 1.0 - u  # exact: (2^23 - m - 0.5) / 2^23 has 24 significant bits
        series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
        e = tl.where(v < 0.0078125, series, -libdevice.fast_logf(u))
        return -libdevice.fast_logf(e)
    else:
        offset = ((m & 255).to(tl.float32) - 127.5) * (0.45 * 32.0 * SCREEN_WINDOW_INTERPRETED / 128.0)
        return offset - tl.log(-tl.log(u))


@triton.jit
def best_score(x, idx, start, region, seed, out_index, row_ptr, t, PRECISE: tl.constexpr):
    """The best race score over the chunk's tokens in `region` and its index (ties: the lowest), exact.
    x: the chunk's logits (still to be divided by t) at absolute indices idx, row_ptr + idx.
    Every token whose cheap score is within two windows of the best cheap score may be the winner;
    when that is one token, only its exact score is computed, else the chunk's (ties, -inf, NaN)."""
    cheap = tl.where(
        region, x * (1.0 / t) + _screen_gumbel(_race_bits(idx, seed, out_index), PRECISE), float("-inf")
    )
    top, arg = tl.max(cheap, 0, return_indices=True)
    if PRECISE:
        window = SCREEN_WINDOW * (tl.abs(top) + 32.0)
    else:
        window = SCREEN_WINDOW_INTERPRETED * (tl.abs(top) + 32.0)
    near = region & ~(cheap < top - 2.0 * window)  # NaN scores count as near
    if (tl.sum(near.to(tl.int32), 0) == 1) & (tl.abs(top) < float("inf")):
        best_index = start + arg
        best = gumbel(scaled(tl.load(row_ptr + best_index), t, PRECISE), best_index, seed, out_index, PRECISE)
    else:
        # Reloaded, not reused: the compiler would otherwise hoist the exact division of every token
        # out of this rare branch (and out of the caller's top-p sum) into the common path.
        x = scaled(tl.load(row_ptr + idx, mask=region, other=0.0), t, PRECISE)
        score = tl.where(region, gumbel(x, idx, seed, out_index, PRECISE), float("-inf"))
        best, arg = tl.max(score, 0, return_indices=True)
        best_index = start + arg
    return best, best_index
