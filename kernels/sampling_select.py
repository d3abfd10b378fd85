"""The k-th largest x of a row without sorting it: radix select on order keys, a byte a level.

The rejection variant (kernels/sampling_rejection.py) needs it for rows with top-k and top-p: the
reference normalises their nucleus over the top-k survivors, so the test of a winner needs that
set's mass, which needs its threshold, the k-th largest x. `_order_key` maps x to an integer of the
same order (equal x, equal key), so the k-th largest key, found a byte at a time from the top, is the
k-th largest x's: at each level the row's tokens that share the bytes chosen so far are binned by
their next byte, and the level keeps the bin that holds the k-th of them. A bin that holds exactly
the tokens still needed settles it early; the threshold is then the smallest key of that bin.

A row's select state is `RejectionRows.select` [S, 3] int64: the bytes chosen (or, once done, the
threshold key), the tokens still needed below them, and the level (SELECT_LEVELS: done). The chunks
of a level add their bins into `select_hist` [S, SELECT_BINS], which the level's decision reads and
zeroes. A level is a pass of its own (`_select_chunk`, then `_select_level` decides it), so a select
costs up to four passes (binning the first level in the row's first race instead was slower,
bench/results/2026-11-29-h200-top-k-top-p-select.md). A level that leaves few tokens from its kept
bin up ends the select there: the row gathers them (GATHERING, kernels/sampling_gather.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.sampling import scaled

SELECT_BINS = tl.constexpr(256)  # a byte of the key a level
SELECT_LEVELS = tl.constexpr(4)  # 32-bit keys; the level field's value once the threshold is known
GATHERING = tl.constexpr(5)  # the level field's value while the row gathers (sampling_gather.py)


@triton.jit
def _order_key(x):
    """x's place in float order as a uint32: x < y gives a smaller key, x == y the same one (-0.0 is
    keyed as +0.0). Non-negative floats order as their bits, negative ones reversed. 32-bit, since
    64-bit keys doubled the registers of the register-capped queue kernel."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, ~u, u | 0x80000000)


@triton.jit
def _level_hist(key, inb, prefix, level):
    """The tokens whose key starts with the `level` bytes `prefix`, binned by their next byte."""
    at = key >> tl.cast(24 - 8 * level, tl.uint32)  # the chosen bytes, then the next
    match = inb & ((at >> 8) == prefix.to(tl.uint32))
    digit = (at & 255).to(tl.int32)
    hist = tl.histogram(tl.where(match, digit, 0), SELECT_BINS)
    bins = tl.arange(0, SELECT_BINS)
    return hist - tl.where(bins == 0, tl.sum((~match).to(tl.int32), 0), 0)  # the others went to bin 0


@triton.jit
def _choose_byte(hist, need):
    """The highest bin b whose bins b and up hold `need` tokens: (b, the tokens in b, the tokens still
    needed from b once the bins above it are in)."""
    bins = tl.arange(0, SELECT_BINS)
    from_bin = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # non-increasing in the bin
    b = tl.sum((from_bin >= need).to(tl.int32), 0) - 1
    in_b = tl.sum(tl.where(bins == b, hist, 0), 0)
    above = tl.sum(tl.where(bins == b, from_bin, 0), 0) - in_b
    return b, in_b, need - above


@triton.jit
def _select_chunk(r, c, logits_ptr, stride, temperature_ptr, select_ptr, select_hist_ptr, V, CHUNK: tl.constexpr,
                  PRECISE: tl.constexpr):  # fmt: skip
    """Chunk c of row r at its select level: its bins added into the row's (skipping empty ones, which
    past the first level are nearly all)."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=0.0)
    key = _order_key(scaled(raw, tl.load(temperature_ptr + r), PRECISE))
    hist = _level_hist(key, inb, tl.load(select_ptr + r * 3), tl.load(select_ptr + r * 3 + 2))
    bins = tl.arange(0, SELECT_BINS)
    tl.atomic_add(select_hist_ptr + r * SELECT_BINS + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _select_known(r, select_ptr):
    return tl.load(select_ptr + r * 3 + 2) == SELECT_LEVELS


@triton.jit
def _threshold(r, select_ptr):
    """The top-k set's threshold key, once the select is known: the set is every key from it up."""
    return tl.load(select_ptr + r * 3).to(tl.uint32)


@triton.jit
def _select_level(r, top_k_ptr, select_ptr, select_hist_ptr, gather_ptr, GATHER_CAP: tl.constexpr):
    """Row r's level is binned: keep the byte of the k-th token and zero the bins for the next level.
    Returns whether the threshold is now known. When at most GATHER_CAP tokens lie from the kept
    bin's smallest key up, the row gathers them instead (GATHERING, with that key as the row's gather
    bound; sampling_gather.py)."""
    bins = tl.arange(0, SELECT_BINS)
    hist = tl.load(select_hist_ptr + r * SELECT_BINS + bins, cache_modifier=".cg")
    tl.store(select_hist_ptr + r * SELECT_BINS + bins, tl.zeros([SELECT_BINS], tl.int32))
    level = tl.load(select_ptr + r * 3 + 2)
    top_k = tl.load(top_k_ptr + r)
    need = tl.where(level == 0, top_k, tl.load(select_ptr + r * 3 + 1))
    b, in_b, need = _choose_byte(hist, need)
    prefix = tl.load(select_ptr + r * 3) * 256 + b
    level += 1
    smallest = prefix << (32 - 8 * level)  # the bin's smallest key
    gather = top_k - need + in_b <= GATHER_CAP  # the tokens above the bin, and the bin's
    done = ((in_b == need) | (level == SELECT_LEVELS)) & ~gather
    if gather:
        tl.store(gather_ptr + r * 2, smallest)
        tl.store(gather_ptr + r * 2 + 1, tl.zeros([], tl.int64))
        tl.store(select_ptr + r * 3 + 2, tl.full([], GATHERING, tl.int64))
    elif done:  # every key from it up is in the set
        tl.store(select_ptr + r * 3, smallest)
        tl.store(select_ptr + r * 3 + 2, tl.full([], SELECT_LEVELS, tl.int64))
    else:
        tl.store(select_ptr + r * 3, prefix)
        tl.store(select_ptr + r * 3 + 1, need.to(tl.int64))
        tl.store(select_ptr + r * 3 + 2, level)
    return done


@triton.jit
def _kth_key(row, t, V, top_k, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """The k-th largest key of a row in one program (the finisher's: rows the chunked passes left)."""
    prefix = tl.zeros([], tl.int64)
    need = top_k
    offs = tl.arange(0, BLOCK)
    for level in tl.static_range(SELECT_LEVELS):
        hist = tl.zeros([SELECT_BINS], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            inb = idx < V
            key = _order_key(scaled(tl.load(row + idx, mask=inb, other=0.0), t, PRECISE))
            hist += _level_hist(key, inb, prefix, level)
        b, _, need = _choose_byte(hist, need)
        prefix = prefix * 256 + b
    return prefix
