"""A row with top-k and top-p decided from its gathered candidates, once they are few.

A select level (kernels/sampling_select.py) keeps the bin that holds the k-th largest key; every
token from that bin's smallest key up is then a candidate, and the top-k set lies among them. When
there are at most `cap` of them, one pass writes their indices, and the finisher's program for the
row (kernels/sampling_finish.py; the queue kernel's registers are capped) ranks them: the set's
threshold, its mass, the nucleus and the race among the kept tokens come out of that sort, so the
row needs none of the select levels, races and tests that would follow.

While a row gathers, its select state's level is GATHERING, its first word the bin's smallest key
and its second the count of indices written. A row with both has no top-k cut, so its rows of
`part_hist` (C * CUT_BINS int32s) hold the indices.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.sampling import gumbel, scaled
from blink_appliance.kernels.sampling_rejection import _mass_term, _min_p_floor
from blink_appliance.kernels.sampling_select import GATHERING, _order_key

GATHER_CAP = 256  # candidates a row may gather (a power of two: they are sorted in one program)
GATHERED = tl.constexpr(4)  # a row's status once its candidates are written: the finisher decides it


@triton.jit
def _gathering(r, select_ptr):
    return tl.load(select_ptr + r * 3 + 2) == GATHERING


@triton.jit
def _gather_chunk(r, c, logits_ptr, stride, temperature_ptr, select_ptr, gathered_ptr, row_words, V,
                  CHUNK: tl.constexpr, CAP: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """Chunk c of row r: the indices of its tokens at or above the bound, appended to the row's."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=0.0)
    key = _order_key(scaled(raw, tl.load(temperature_ptr + r), PRECISE))
    take = inb & (key >= tl.load(select_ptr + r * 3).to(tl.uint32))
    if tl.max(take.to(tl.int32), 0) > 0:  # a slot a token (a chunk holds few): no scan, few registers
        count = select_ptr + r * 3 + 1 + tl.zeros([CHUNK], tl.int32)
        pos = tl.atomic_add(count, tl.full([CHUNK], 1, tl.int64), mask=take, sem="relaxed")
        tl.store(gathered_ptr + r * row_words + pos, idx, mask=take & (pos < CAP))


@triton.jit
def _gather_row(
    r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr,
    row_max_ptr, row_lse_ptr, select_ptr, gathered_ptr, row_words, CAP: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Row r's candidates are written: the race winner among its kept tokens, ranked in (value
    descending, index ascending) order as the reference ranks them. Its top-k set is the candidates
    from the k-th key up (ties included), the nucleus the set's prefix whose mass ahead is below top_p
    of the set's (summed as the test sums, MASS_PRECISION), and min-p's floor applies as in a race."""
    row = logits_ptr + tl.cast(r, tl.int64) * stride
    t = tl.load(temperature_ptr + r)
    offs = tl.arange(0, CAP)
    n = tl.load(select_ptr + r * 3 + 1, cache_modifier=".cg").to(tl.int32)
    m = offs < n
    idx = tl.load(gathered_ptr + r * row_words + offs, mask=m, other=0, cache_modifier=".cg")
    key = _order_key(scaled(tl.load(row + idx, mask=m, other=0.0), t, PRECISE))
    # Every real entry packs above the padding's 0, so the n of them rank first.
    low = (4294967295 - idx.to(tl.int64)).to(tl.uint64)
    ranked = tl.sort(tl.where(m, (key.to(tl.uint64) << 32) | low, 0), descending=True)
    idx = (4294967295 - (ranked & 4294967295).to(tl.int64)).to(tl.int32)
    key = (ranked >> 32).to(tl.uint32)
    kth = tl.max(tl.where(offs == tl.load(top_k_ptr + r) - 1, key, 0), 0)
    in_set = m & (key >= kth)
    raw = tl.load(row + idx, mask=m, other=0.0)
    x = scaled(raw, t, PRECISE)
    q = tl.where(in_set, _mass_term(raw, t, tl.load(row_lse_ptr + r)), 0.0)
    floor = _min_p_floor(tl.load(row_max_ptr + r), tl.load(min_p_ptr + r), PRECISE)
    kept = in_set & ((tl.cumsum(q, 0) - q) < tl.load(top_p_ptr + r) * tl.sum(q, 0)) & (x >= floor)
    score = tl.where(
        kept, gumbel(x, idx, tl.load(seed_ptr + r), tl.load(out_index_ptr + r), PRECISE), float("-inf")
    )
    best = tl.max(score, 0)
    first = tl.max(tl.where(offs == 0, idx, -1), 0)  # the row's max: kept by every filter
    w = tl.min(tl.where(kept & (score == best), idx, 2147483647), 0)
    return tl.where(best > float("-inf"), w, first).to(tl.int64)
