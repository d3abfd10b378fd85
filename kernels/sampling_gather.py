"""Top-k rows decided from their gathered candidates, once they are few (the variants with top-k,
`rejection_top_k` and `rejection_top_k_top_p`, for each of their rows with top-k).

A row gathers the indices of every token at or above a bound key that the top-k set lies above, and
the finisher's program for the row (kernels/sampling_finish.py; the queue kernel's registers are
capped) ranks them: the set's threshold, its mass, the nucleus and the race among the kept tokens
come out of that sort, so the row needs none of the cuts, select levels, races and tests that would
otherwise follow. Two bounds lead there:

- **the k-th largest chunk max**, known after the row's first race (`_chunk_bound`): k chunks each
  hold a token at or above it, so the k largest tokens are at or above it. When k chunk maxima lie
  above the winner, so do k tokens, and the test would reject it: the row has a gathering pass
  instead, and when the cap held every candidate the finisher decides the row (else the test runs
  after all). On flat logits that replaces the test and the select levels (or a row of top-k alone's
  cut races and their tests); the candidates are few when the largest tokens are spread over the
  chunks. A winner near the top (peaked logits) keeps its plain test; the code's presence costs
  such a row of top-k alone 6-8 µs a token in the loop, against 21-137 µs gained on flat logits.
- **a select level's kept bin** (kernels/sampling_select.py; the variant with both only): every
  token from that bin's smallest key up, gathered in a pass of its own (level GATHERING) when they
  are few.

A row's `RejectionRows.gather` words are the bound key and the count of indices appended to its row
of `gathered`; past the cap they are only counted.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.sampling import _mass_term, _min_p_floor, gumbel, scaled
from blink_appliance.kernels.sampling_select import GATHERING, _order_key

GATHER_CAP = 256  # candidates a row may gather (a power of two: they are sorted in one program)
GATHERED = tl.constexpr(4)  # a row's status once its candidates are written: the finisher decides it
GATHER_NEXT = tl.constexpr(5)  # a row's status while its gathering pass is pending


@triton.jit
def _gathering(r, select_ptr):
    """A select pass of row r gathers (its level is GATHERING)."""
    return tl.load(select_ptr + r * 3 + 2) == GATHERING


@triton.jit
def _chunk_bound(r, status, above, top_k_ptr, part_max_ptr, status_ptr, gather_ptr, n_chunks,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    """After row r's first race, whose winner goes to its test (status 2) with `above` chunk maxima
    above it: when top_k of them do, so do top_k tokens, and the test would reject the winner; the
    row gathers instead (GATHER_NEXT), every token at or above its k-th largest chunk max. Returns the
    row's status. `part_max` holds each chunk's largest x (the race wrote it)."""
    top_k = tl.load(top_k_ptr + r)
    if (status == 2) & (top_k >= 1) & (above >= top_k):
        offs = tl.arange(0, BLOCK_C)
        # Read again (only rows that gather pay for it): handing the pick's vector over instead did not
        # lower the register-capped queue kernel's spills (sm_90 ptxas, 876 against 868 bytes).
        maxima = tl.load(
            part_max_ptr + r * n_chunks + offs,
            mask=offs < n_chunks,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        kth = tl.max(tl.where(offs == top_k - 1, tl.sort(maxima, descending=True), float("-inf")), 0)
        tl.store(gather_ptr + r * 2, _order_key(kth).to(tl.int64))
        tl.store(gather_ptr + r * 2 + 1, tl.zeros([], tl.int64))
        status = tl.full([], GATHER_NEXT, tl.int32)
        tl.store(status_ptr + r, status)
    return status


@triton.jit
def _gather_chunk(r, c, logits_ptr, stride, temperature_ptr, gather_ptr, gathered_ptr, V, CHUNK: tl.constexpr,
                  CAP: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """Chunk c of row r: the indices of its tokens at or above the bound key, appended to the row's."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=0.0)
    key = _order_key(scaled(raw, tl.load(temperature_ptr + r), PRECISE))
    take = inb & (key >= tl.load(gather_ptr + r * 2).to(tl.uint32))
    if tl.max(take.to(tl.int32), 0) > 0:  # a slot a token (a chunk holds few): no scan, few registers
        count = gather_ptr + r * 2 + 1 + tl.zeros([CHUNK], tl.int32)
        pos = tl.atomic_add(count, tl.full([CHUNK], 1, tl.int64), mask=take, sem="relaxed")
        tl.store(gathered_ptr + r * CAP + pos, idx, mask=take & (pos < CAP))


@triton.jit
def _after_gathering(r, status_ptr, gather_ptr, CAP: tl.constexpr):
    """Row r's gathering pass is done: the finisher decides the row from its candidates when the cap
    held them all, else the row has its winner's test after all."""
    status = tl.where(tl.load(gather_ptr + r * 2 + 1, cache_modifier=".cg") <= CAP, GATHERED, 2)
    tl.store(status_ptr + r, status)
    return status


@triton.jit
def _gather_row(
    r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr,
    row_max_ptr, row_lse_ptr, gather_ptr, gathered_ptr, CAP: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Row r's candidates are written: the race winner among its kept tokens, ranked in (value
    descending, index ascending) order as the reference ranks them. Its top-k set is the candidates
    from the k-th key up (ties included), the nucleus the set's prefix whose mass ahead is below top_p
    of the set's (summed as the test sums, MASS_PRECISION; top_p 1 keeps the set), and min-p's floor
    applies as in a race."""
    row = logits_ptr + tl.cast(r, tl.int64) * stride
    t = tl.load(temperature_ptr + r)
    offs = tl.arange(0, CAP)
    n = tl.load(gather_ptr + r * 2 + 1, cache_modifier=".cg").to(tl.int32)
    m = offs < n
    idx = tl.load(gathered_ptr + r * CAP + offs, mask=m, other=0, cache_modifier=".cg")
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
    top_p = tl.load(top_p_ptr + r)
    # A row without top-p has no logsumexp (the race sums only for top-p rows): its masses are not summed.
    # (Nested: Triton's CPU interpreter cannot `&` a tensor with a scalar condition.)
    q = tl.where(in_set, tl.where(top_p < 1.0, _mass_term(raw, t, tl.load(row_lse_ptr + r)), 0.0), 0.0)
    limit = tl.where(top_p < 1.0, top_p * tl.sum(q, 0), float("inf"))
    floor = _min_p_floor(tl.load(row_max_ptr + r), tl.load(min_p_ptr + r), PRECISE)
    kept = in_set & ((tl.cumsum(q, 0) - q) < limit) & (x >= floor)
    score = tl.where(
        kept, gumbel(x, idx, tl.load(seed_ptr + r), tl.load(out_index_ptr + r), PRECISE), float("-inf")
    )
    best = tl.max(score, 0)
    first = tl.max(tl.where(offs == 0, idx, -1), 0)  # the row's max: kept by every filter
    w = tl.min(tl.where(kept & (score == best), idx, 2147483647), 0)
    return tl.where(best > float("-inf"), w, first).to(tl.int64)
