"""Triton kernels of the device sampler (blink_appliance/engine/loop/sampler.py).

- `race`: the exponential race (Gumbel-max) over the kept tokens of every row, chunked over the
  vocabulary: each program writes its chunk's best (score, index); the caller reduces the chunks.
  Greedy rows race on the raw values (plain argmax). Ties go to the lowest index throughout.
  A chunk's best (`best_score`, also the rejection variant's) is screened with a cheap score and
  exact: only the tokens the screen cannot tell apart get their exact scores.
- `exact_cut`: the slow exact path for rows whose top-k / top-p cut does not lie inside the sorted
  candidates: bisection over the float order of the row (one program per row; other rows return at
  once).

The kept set of a random row is `(x > v_cut or (x == v_cut and index <= i_cut)) and x >= min_p_cut`:
top-k and top-p each keep a prefix of the row in (value descending, index ascending) order, so their
intersection is a prefix, given by its last element (v_cut, i_cut); min-p keeps every token at or
above a value.

The uniforms are engine/reference/rng.py's splitmix64 counter hash on uint64 lanes (wrapping multiply, logical
shift), bit-for-bit the CPU definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

GAMMA = tl.constexpr(0x9E3779B97F4A7C15)  # engine/reference/rng.py
INT64_MAX = 2**63 - 1
# The sampler variants (the loop's sampler SWITCH), ordered by what they serve: each serves every row
# a smaller one serves, so schedule takes the largest any row needs. engine/loop/sampler.py has them.
SAMPLER_GREEDY = 0  # argmax rows only
SAMPLER_REJECTION = 1  # temperature, top-p, min-p (kernels/sampling_rejection.py)
SAMPLER_REJECTION_TOP_K = 2  # and rows with top-k but not top-p (its count and cut compiled in)
SAMPLER_FULL = 3  # and top-k with top-p
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
    SAMPLER_FULL < SAMPLER_LOGPROBS
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
def best_score(
    x, idx, start, region, seed, out_index, row_ptr, t, SCALE: tl.constexpr, PRECISE: tl.constexpr
):
    """The best race score over the chunk's tokens in `region` and its index (ties: the lowest), exact.
    x: the chunk's logits (SCALE: still to be divided by t) at absolute indices idx, row_ptr + idx.
    Every token whose cheap score is within two windows of the best cheap score may be the winner;
    when that is one token, only its exact score is computed, else the chunk's (ties, -inf, NaN)."""
    if SCALE:
        cheap_x = x * (1.0 / t)
    else:
        cheap_x = x
    cheap = tl.where(
        region, cheap_x + _screen_gumbel(_race_bits(idx, seed, out_index), PRECISE), float("-inf")
    )
    top, arg = tl.max(cheap, 0, return_indices=True)
    if PRECISE:
        window = SCREEN_WINDOW * (tl.abs(top) + 32.0)
    else:
        window = SCREEN_WINDOW_INTERPRETED * (tl.abs(top) + 32.0)
    near = region & ~(cheap < top - 2.0 * window)  # NaN scores count as near
    if (tl.sum(near.to(tl.int32), 0) == 1) & (tl.abs(top) < float("inf")):
        best_index = start + arg
        x_best = tl.load(row_ptr + best_index)
        if SCALE:
            x_best = scaled(x_best, t, PRECISE)
        best = gumbel(x_best, best_index, seed, out_index, PRECISE)
    else:
        # Reloaded, not reused: the compiler would otherwise hoist the exact division of every token
        # out of this rare branch (and out of the caller's top-p sum) into the common path.
        x = tl.load(row_ptr + idx, mask=region, other=0.0)
        if SCALE:
            x = scaled(x, t, PRECISE)
        score = tl.where(region, gumbel(x, idx, seed, out_index, PRECISE), float("-inf"))
        best, arg = tl.max(score, 0, return_indices=True)
        best_index = start + arg
    return best, best_index


@triton.jit
def _race_kernel(
    x_ptr, x_stride, random_ptr, seed_ptr, out_index_ptr, v_cut_ptr, i_cut_ptr, min_p_cut_ptr,
    part_score_ptr, part_index_ptr, V, n_chunks, CHUNK: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    x = tl.load(x_ptr + r.to(tl.int64) * x_stride + idx, mask=inb, other=float("-inf"))
    rnd = tl.load(random_ptr + r)
    if rnd != 0:
        v_cut = tl.load(v_cut_ptr + r)
        i_cut = tl.load(i_cut_ptr + r)
        min_p_cut = tl.load(min_p_cut_ptr + r)
        keep = inb & ((x > v_cut) | ((x == v_cut) & (idx.to(tl.int64) <= i_cut))) & (x >= min_p_cut)
        best = tl.full([], float("-inf"), tl.float32)
        best_index = c * CHUNK
        # Chunks with nothing kept (most of them under top-k / top-p) skip the hash.
        if tl.max(keep.to(tl.int32), 0) > 0:
            best, best_index = best_score(
                x, idx, c * CHUNK, keep, tl.load(seed_ptr + r), tl.load(out_index_ptr + r),
                x_ptr + r.to(tl.int64) * x_stride, 1.0, SCALE=False, PRECISE=PRECISE,
            )  # fmt: skip
    else:
        best = tl.max(x, 0)
        best_index = c * CHUNK + tl.argmax(x, 0)
    tl.store(part_score_ptr + r * n_chunks + c, best)
    tl.store(part_index_ptr + r * n_chunks + c, best_index.to(tl.int64))


def race(
    x: torch.Tensor,
    random: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    v_cut: torch.Tensor,
    i_cut: torch.Tensor,
    min_p_cut: torch.Tensor,
    part_score: torch.Tensor,
    part_index: torch.Tensor,
    chunk: int,
    precise: bool,
) -> None:
    """Per row and vocabulary chunk, the best (score, index) into part_score/part_index [S, n_chunks]."""
    rows, vocab = x.shape
    n_chunks = part_score.shape[1]
    if n_chunks != triton.cdiv(vocab, chunk) or part_index.shape != part_score.shape:
        raise ValueError(f"partials {tuple(part_score.shape)} do not fit vocab {vocab} in chunks of {chunk}")
    _race_kernel[(rows, n_chunks)](
        x, x.stride(0), random, seed, output_index, v_cut, i_cut, min_p_cut, part_score, part_index,
        vocab, n_chunks, CHUNK=chunk, PRECISE=precise, num_warps=4,
    )  # fmt: skip


@triton.jit
def _masked_lse_kernel(x_ptr, x_stride, row_max_ptr, threshold_ptr, lse_ptr, V, BLOCK: tl.constexpr,
                       PRECISE: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * x_stride
    hi = tl.load(row_max_ptr + r)
    threshold = tl.load(threshold_ptr + r)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        total += tl.where(x >= threshold, _exp(x - hi, PRECISE), 0.0)
    tl.store(lse_ptr + r, hi + _log(tl.sum(total, 0), PRECISE))


def masked_logsumexp(
    x: torch.Tensor, row_max: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor, precise: bool
) -> None:
    """out[r] = logsumexp of x[r] over x >= threshold[r] (row_max[r] = max of x[r]): one read of x."""
    rows, vocab = x.shape
    block = min(2048, triton.next_power_of_2(vocab))
    _masked_lse_kernel[(rows,)](x, x.stride(0), row_max, threshold, out, vocab, BLOCK=block, PRECISE=precise,
                                num_warps=8)  # fmt: skip


@triton.jit
def _key(x):
    """float32 -> int32 whose signed order is the float order (negative floats: magnitude bits flipped)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _val(k):
    k = k.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _exact_cut_kernel(
    x_ptr, x_stride, random_ptr, exact_ptr, top_k_ptr, top_p_ptr, v_cut_ptr, i_cut_ptr, V,
    BLOCK: tl.constexpr, PROBES: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Searches run over int32 keys of the float order; each pass over the row tests PROBES evenly
    spaced keys at once, so a search takes about 32 / log2(PROBES + 1) passes instead of 32."""
    r = tl.program_id(0)
    rnd = tl.load(random_ptr + r)
    exact = tl.load(exact_ptr + r)
    if (rnd != 0) & (exact == 0):
        row = x_ptr + r.to(tl.int64) * x_stride
        k = tl.load(top_k_ptr + r)
        p = tl.load(top_p_ptr + r)
        offs = tl.arange(0, BLOCK)
        probe = tl.arange(0, PROBES).to(tl.int64)
        hi_x = tl.full([], float("-inf"), tl.float32)
        lo_x = tl.full([], float("inf"), tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            m = idx < V
            x = tl.load(row + idx, mask=m, other=0.0)
            hi_x = tl.maximum(hi_x, tl.max(tl.where(m, x, float("-inf")), 0))
            lo_x = tl.minimum(lo_x, tl.min(tl.where(m, x, float("inf")), 0))

        # top-k: the k-th largest value = the largest key T with count(x >= val(T)) >= k.
        threshold = tl.full([], float("-inf"), tl.float32)
        if (k > 0) & (k < V):
            lo = _key(lo_x).to(tl.int64)  # count(x >= lo) = V >= k
            hi = _key(hi_x).to(tl.int64)
            while lo < hi:
                step = tl.maximum((hi - lo + PROBES) // (PROBES + 1), 1)
                keys = tl.minimum(lo + (probe + 1) * step, hi)
                t = _val(keys)
                count = tl.zeros([PROBES], tl.int64)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    m = idx < V
                    x = tl.load(row + idx, mask=m, other=0.0)
                    count += tl.sum((m[:, None] & (x[:, None] >= t[None, :])).to(tl.int64), 0)
                ok = count >= k  # true for a leading run of probes (count falls as the key rises)
                n_ok = tl.sum(ok.to(tl.int32), 0)
                lo = tl.maximum(lo, tl.max(tl.where(ok, keys, lo), 0))
                hi = tl.where(n_ok < PROBES, tl.min(tl.where(ok, hi, keys - 1), 0), hi)
            threshold = _val(lo)

        v_cut = threshold
        i_cut = tl.full([], 9223372036854775807, tl.int64)
        if p < 1.0:
            # top-p over the survivors: the kept prefix ends at the smallest value v* whose mass
            # above it, M(v*) = sum of q over survivors with x > v*, is < p; of the tokens tied at v*
            # (ranked by index), the t-th is kept while M(v*) + t * q(v*) < p.
            total = tl.zeros([], tl.float32)
            lo_s = tl.full([], float("inf"), tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                x = tl.load(row + idx, mask=m, other=0.0)
                surv = m & (x >= threshold)
                total += tl.sum(tl.where(surv, _exp(x - hi_x, PRECISE), 0.0), 0)
                lo_s = tl.minimum(lo_s, tl.min(tl.where(surv, x, float("inf")), 0))
            lse = hi_x + _log(total, PRECISE)
            # The smallest key T with M(val(T)) < p; M(hi) = 0 < p.
            lo = _key(lo_s).to(tl.int64)
            hi = _key(hi_x).to(tl.int64)
            while lo < hi:
                step = tl.maximum((hi - lo + PROBES - 1) // PROBES, 1)
                keys = tl.minimum(lo + probe * step, hi)  # keys[0] = lo
                t = _val(keys)
                mass = tl.zeros([PROBES], tl.float32)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    m = idx < V
                    x = tl.load(row + idx, mask=m, other=0.0)
                    q = tl.where(m & (x >= threshold), _exp(x - lse, PRECISE), 0.0)
                    mass += tl.sum(tl.where(x[:, None] > t[None, :], q[:, None], 0.0), 0)
                below = mass < p  # false for a leading run of probes, then true
                n_above = PROBES - tl.sum(below.to(tl.int32), 0)
                first = tl.min(tl.where(below, keys, hi), 0)
                lo = tl.where(n_above == 0, lo, tl.max(tl.where(below, lo, keys + 1), 0))
                hi = tl.where(n_above == 0, lo, first)
            v_star = _val(lo)
            mass = tl.zeros([], tl.float32)
            ties = tl.zeros([], tl.int64)
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                x = tl.load(row + idx, mask=m, other=0.0)
                mass += tl.sum(tl.where(m & (x > v_star), _exp(x - lse, PRECISE), 0.0), 0)
                ties += tl.sum((m & (x == v_star)).to(tl.int64), 0)
            q_star = _exp(v_star - lse, PRECISE)
            n_keep = tl.zeros([], tl.int64)
            for t0 in range(0, ties, BLOCK):
                t = t0 + offs
                n_keep += tl.sum(((t < ties) & (mass + t.to(tl.float32) * q_star < p)).to(tl.int64), 0)
            # The index of the n_keep-th token tied at v*, in index order.
            seen = tl.zeros([], tl.int64)
            i_cut = tl.full([], -1, tl.int64)
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                x = tl.load(row + idx, mask=m, other=0.0)
                tie = (m & (x == v_star)).to(tl.int64)
                rank = tl.cumsum(tie, 0) + seen
                hit = (tie != 0) & (rank == n_keep)
                i_cut = tl.maximum(i_cut, tl.max(tl.where(hit, idx.to(tl.int64), -1), 0))
                seen += tl.sum(tie, 0)
            v_cut = v_star
        tl.store(v_cut_ptr + r, v_cut)
        tl.store(i_cut_ptr + r, i_cut)


def exact_cut(
    x: torch.Tensor,
    random: torch.Tensor,
    exact: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    v_cut: torch.Tensor,
    i_cut: torch.Tensor,
    precise: bool,
    block: int = 512,
    probes: int = 16,
) -> None:
    """Overwrite (v_cut, i_cut) of the random rows with exact == 0 by the exact full-row search."""
    rows, vocab = x.shape
    block = min(block, triton.next_power_of_2(vocab))
    _exact_cut_kernel[(rows,)](
        x, x.stride(0), random, exact, top_k, top_p, v_cut, i_cut, vocab,
        BLOCK=block, PROBES=probes, PRECISE=precise, num_warps=8,
    )  # fmt: skip
