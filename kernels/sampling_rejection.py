"""Triton kernels of the device sampler's rejection variant (engine/loop/sampler.py `rejection`): the
exponential race over a row's kept tokens without sorting it, for rows with top-p, top-k or both, min-p
and temperature.

The kept set of such a row is a prefix of the row in (value descending, index ascending) order, so
the race winner over the kept set is found by racing over a *region* that holds it:

- race every token of the region (chunked over the vocabulary; `race_region`, whose last chunk of
  a row to finish picks the row's winner);
- test the winner w: min-p (x_w >= max + log(min_p)), top-p (the mass ranked before w is < top_p)
  and top-k (fewer than top_k tokens lie strictly above w); `_mass_chunk` counts both a chunk at a time, and
  the last chunk of a row to finish decides;
- if w is kept it is the answer, since the kept set lies inside the region; otherwise every kept
  token ranks before w, so the region shrinks to the tokens ranked before w and the race runs again.
  A top-k test also bins the tokens above w (`_cut_bin`), and the region shrinks further to the
  highest bins that still hold top_k tokens: on flat logits a rejected winner alone only halves it.
- with both top-k and top-p (compiled in with BOTH, a variant of its own) the nucleus is
  normalised over the top-k set, whose mass is unknown until its threshold is: the test sums the
  mass at or above w instead of cutting (inside that set when w passes top-k), and decides when that
  bound or the whole row's mass does; otherwise select passes find the threshold
  (kernels/sampling_select.py), and w is tested again against the set's exact mass, or the race runs
  again inside the set.

The random numbers are the race's (kernels/sampling.py), so the token is the reference's. A row's
state lives in `RejectionRows`: status 0 done, 1 race pending in the region ahead of (bound_x,
bound_i), 2 top-p / top-k test of the candidate pending, 3 select pass pending, 4 candidates gathered
for the finisher to rank, 5 gathering pass pending (kernels/sampling_gather.py). This module has the
chunk-level steps; one launch runs them as a work queue (kernels/sampling_rounds.py), and `finish`
(kernels/sampling_finish.py) then loops the rare rows still undecided, one program per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from blink_appliance.kernels.sampling import _exp, _log, _mass_term, _min_p_floor, best_score, scaled
from blink_appliance.kernels.sampling_gather import GATHER_CAP
from blink_appliance.kernels.sampling_select import (
    SELECT_BINS,
    SELECT_LEVELS,
    _order_key,
    _select_known,
    _select_level,
    _threshold,
)

# MASS_PRECISION: the nucleus's masses (the logsumexp's sums, the mass ranked before a candidate) use
# x * (1/t) and the GPU's fast exp: a relative error near 1e-6 a term, below what summing 128k fp32
# terms in any order already carries: the reference's fp32 cumsum and this sum can disagree only for
# a candidate whose mass ahead lies that close to top_p, as they could with exact terms. The race's
# scores and the ranks stay exact.
TIE_BAND = tl.constexpr(2.0**-20)  # logits this close (relatively) may tie once divided by t


CUT_BINS = tl.constexpr(32)  # a top-k test's bins between the rejected winner and the row's max
MAX_ROUNDS = 8  # chunked race-and-test rounds a row may have before `finish` takes it
# A row queues at most a test per race, a race per test, its select levels and the test after them, and
# a gathering pass (sampling_gather.py) with the test after it.
QUEUE_SLOTS_PER_ROW = 2 * MAX_ROUNDS + SELECT_LEVELS.value + 2
QUEUE_COUNTERS = 4  # the queue's counters (kernels/sampling_rounds.py), each on a line of its own:
COUNTER_STRIDE = 32  # int32s a 128-byte line


@dataclass
class RejectionRows:
    """Per-row state and per-chunk partials of the rejection variant (allocated once, reused)."""

    status: torch.Tensor  # [S] int32
    bound_x: torch.Tensor  # [S] fp32: the region is the tokens ranked before (bound_x, bound_i)
    bound_i: torch.Tensor  # [S] int64
    row_max: torch.Tensor  # [S] fp32: max of x
    row_lse: torch.Tensor  # [S] fp32: logsumexp of x (the nucleus's normaliser)
    candidate: torch.Tensor  # [S] int64: the winner under test
    cut: torch.Tensor  # [S, 3] fp32: the region's top-k cut, _cut_bin(x, lo, scale) >= j; j = 0: none
    part_hist: torch.Tensor  # [S, C, CUT_BINS] int32: a top-k test's bins of the tokens above w
    select: torch.Tensor  # [S, 3] int64: top-k with top-p, the threshold's select (sampling_select.py)
    select_hist: torch.Tensor  # [S, SELECT_BINS] int32: a select level's bins; zero between levels
    gather: torch.Tensor  # [S, 2] int64: a top-k row's gather bound key and count (sampling_gather.py)
    gathered: torch.Tensor  # [S, cap] int32: the indices it gathered
    part_score: torch.Tensor  # [S, C] fp32
    part_index: torch.Tensor  # [S, C] int64
    part_max: torch.Tensor  # [S, C] fp32; a top-k with top-p test's mass at or above w, or the set's
    part_sum: torch.Tensor  # [S, C] fp32: sum of exp(x - part_max) over the chunk
    arrived: torch.Tensor  # [S] int32: chunks of the row done in this pass; the last one resets it to 0
    races: torch.Tensor  # [S] int32: chunked races the row has had this step
    queue: torch.Tensor  # [S * QUEUE_SLOTS_PER_ROW] int32: tasks after the first races, -1 = not yet
    counters: (
        torch.Tensor
    )  # [128] int32: the queue's next ticket, tail, rows settled, programs out (32 apart)

    @classmethod
    def allocate(
        cls, rows: int, chunks: int, device: torch.device, gather_cap: int = GATHER_CAP
    ) -> RejectionRows:
        def f32(*shape):
            return torch.zeros(*shape, dtype=torch.float32, device=device)

        def i64(*shape):
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        return cls(
            status=torch.zeros(rows, dtype=torch.int32, device=device), bound_x=f32(rows), bound_i=i64(rows),
            row_max=f32(rows), row_lse=f32(rows), candidate=i64(rows), cut=f32(rows, 3),
            part_hist=torch.zeros(rows, chunks, CUT_BINS.value, dtype=torch.int32, device=device),
            select=i64(rows, 3), select_hist=torch.zeros(rows, SELECT_BINS.value, dtype=torch.int32, device=device),
            gather=i64(rows, 2), gathered=torch.zeros(rows, gather_cap, dtype=torch.int32, device=device),
            part_score=f32(rows, chunks),
            part_index=i64(rows, chunks), part_max=f32(rows, chunks), part_sum=f32(rows, chunks),
            arrived=torch.zeros(rows, dtype=torch.int32, device=device),
            races=torch.zeros(rows, dtype=torch.int32, device=device),
            queue=torch.full((rows * QUEUE_SLOTS_PER_ROW,), -1, dtype=torch.int32, device=device),
            counters=torch.zeros(QUEUE_COUNTERS * COUNTER_STRIDE, dtype=torch.int32, device=device),
        )  # fmt: skip


@dataclass
class SampleRows:
    """The sampler's inputs per row, as schedule wrote them (DeviceState's row_* tensors)."""

    n_rows: torch.Tensor  # [1] int32: rows [0, n_rows) are the step's; the rest are not touched
    temperature: torch.Tensor  # [S] fp32: <= 0 is an argmax row
    top_p: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64: > 0 keeps that many tokens
    min_p: torch.Tensor  # [S] fp32
    seed: torch.Tensor  # [S] int64
    output_index: torch.Tensor  # [S] int64


@triton.jit
def _both(top_k, top_p, V):
    """A row with top-k and top-p: its nucleus is normalised over its top-k set (top_k >= V keeps all)."""
    return (top_k > 0) & (top_k < V) & (top_p < 1.0)


@triton.jit
def _ahead(x, idx, bound_x, bound_i):
    """Tokens ranked before (bound_x, bound_i) in (value descending, index ascending) order. The
    indices compare as int32 (a vocabulary's fit), the int64 bound clamped once."""
    return (x > bound_x) | ((x == bound_x) & (idx < tl.minimum(bound_i, 2147483647).to(tl.int32)))


@triton.jit
def _cut_scale(row_max, x_w):
    """Bins per unit of x above the rejected winner w. The test's histogram and the next races both
    compute it here from the same values, so they agree bit for bit. A winner at the max (no gap) is
    kept, so its bins are never read; the floor only keeps the division finite."""
    return tl.full([], CUT_BINS, tl.float32) / tl.maximum(row_max - x_w, 1e-30)


@triton.jit
def _cut_bin(x, lo, scale):
    """IEEE rounding is monotone, so this is non-decreasing in x: {x : _cut_bin(x) >= j} is every x
    from some threshold up, and a cut that counts top_k tokens in it keeps the whole top-k set."""
    return (x - lo) * scale


@triton.jit
def _race_chunk(
    r, c, logits_ptr, stride, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_index_ptr, bound_x_ptr, bound_i_ptr,
    row_max_ptr, cut_ptr, select_ptr, part_score_ptr, part_index_ptr, part_max_ptr, part_sum_ptr, V, n_chunks,
    CHUNK: tl.constexpr, FIRST: tl.constexpr, ARGMAX: tl.constexpr, PRECISE: tl.constexpr, TOP_K: tl.constexpr,
    BOTH: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r: the best race score in the row's region; the first round also writes the
    chunk's max and sum of exp(x - max) for the row's logsumexp. Argmax rows race on the raw logits."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=float("-inf"))
    out = r * n_chunks + c
    t = tl.load(temperature_ptr + r)
    if ARGMAX or t <= 0.0:
        best, arg = tl.max(raw, 0, return_indices=True)  # ties: the lowest index, as argmax
        best_index = c * CHUNK + arg
    else:
        row = logits_ptr + tl.cast(r, tl.int64) * stride
        seed = tl.load(seed_ptr + r)
        out_index = tl.load(out_index_ptr + r)
        if FIRST:  # the whole row is the region, and no cut or select holds yet this step
            if TOP_K:
                if c == 0:
                    tl.store(cut_ptr + r * 3 + 2, 0.0)
            if BOTH:
                if c == 0:
                    tl.store(select_ptr + r * 3, tl.zeros([], tl.int64))  # no bytes chosen,
                    tl.store(select_ptr + r * 3 + 2, tl.zeros([], tl.int64))  # at level 0
            # IEEE division by t > 0 keeps order, so the max of x / t is the max of x, divided once.
            hi = scaled(tl.max(raw, 0), t, PRECISE)
            tl.store(part_max_ptr + out, hi)
            if tl.load(top_p_ptr + r) < 1.0:  # only top-p reads the logsumexp (MASS_PRECISION)
                q = tl.where(inb, _mass_term(raw, t, hi), 0.0)
                tl.store(part_sum_ptr + out, tl.sum(q, 0))
            best, best_index = best_score(raw, idx, c * CHUNK, inb, seed, out_index, row, t, PRECISE)
        else:
            x = tl.where(inb, scaled(raw, t, PRECISE), float("-inf"))
            region = inb & _ahead(x, idx, tl.load(bound_x_ptr + r), tl.load(bound_i_ptr + r))
            floor = _min_p_floor(tl.load(row_max_ptr + r), tl.load(min_p_ptr + r), PRECISE)
            region = region & (x >= floor)
            if TOP_K:
                cut_j = tl.load(cut_ptr + r * 3 + 2)
                if cut_j > 0.0:
                    region = region & (
                        _cut_bin(x, tl.load(cut_ptr + r * 3), tl.load(cut_ptr + r * 3 + 1)) >= cut_j
                    )
            if BOTH:
                if _select_known(r, select_ptr):  # only rows with both select, so only theirs is known
                    region = region & (_order_key(x) >= _threshold(r, select_ptr))
            best = tl.full([], float("-inf"), tl.float32)
            best_index = c * CHUNK
            if tl.max(region.to(tl.int32), 0) > 0:  # chunks outside the region skip the hash
                best, best_index = best_score(raw, idx, c * CHUNK, region, seed, out_index, row, t, PRECISE)
    tl.store(part_score_ptr + out, best)
    tl.store(part_index_ptr + out, best_index.to(tl.int64))


@triton.jit
def _last_to_arrive(arrived_ptr, r, n_chunks, count):
    """Count `count` chunks of row r done; True for the program that completes the row, which resets
    the count. The atomic releases this program's partials and, for the last, acquires everyone else's."""
    last = tl.atomic_add(arrived_ptr + r, count, sem="acq_rel") == n_chunks - count
    if last:
        tl.store(arrived_ptr + r, 0)
    return last


@triton.jit
def _argmax_kernel(
    logits_ptr, stride, n_rows_ptr, sampled_ptr, status_ptr, part_score_ptr, part_index_ptr, arrived_ptr,
    V, n_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Persistent over the (row, chunk) items of the step's rows: rows past n_rows cost nothing. The
    last chunk of a row to finish picks its winner, so the pick costs no launch of its own."""
    n_items = tl.load(n_rows_ptr) * n_chunks
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        r = item // n_chunks
        _race_chunk(
            r, item % n_chunks, logits_ptr, stride, logits_ptr, logits_ptr, logits_ptr, logits_ptr, logits_ptr,
            logits_ptr, logits_ptr, logits_ptr, logits_ptr, logits_ptr, part_score_ptr, part_index_ptr, logits_ptr,
            logits_ptr, V, n_chunks, CHUNK, FIRST=True, ARGMAX=True, PRECISE=False, TOP_K=False, BOTH=False,
        )  # fmt: skip
        if _last_to_arrive(arrived_ptr, r, n_chunks, 1):
            _pick_row(
                r, logits_ptr, stride, logits_ptr, logits_ptr, logits_ptr, logits_ptr, sampled_ptr, status_ptr, logits_ptr,
                logits_ptr, logits_ptr, logits_ptr, logits_ptr, part_score_ptr, part_index_ptr, logits_ptr,
                logits_ptr, n_chunks, BLOCK_C, FIRST=True, ARGMAX=True, PRECISE=False, TOP_K=False,
            )  # fmt: skip


@triton.jit
def _verdict(x_w, row_max, min_p, top_p, top_k, PRECISE: tl.constexpr):
    """After a race, the winner's next status: RACE again if min-p rejects it (the region shrinks
    to the tokens ranked before it and, once the max is known, to min-p's), TEST if top-p or top-k
    still has to test it, else DONE (kept)."""
    test = (top_p < 1.0) | (top_k > 0)
    return tl.where(x_w < _min_p_floor(row_max, min_p, PRECISE), 1, tl.where(test, 2, 0))


@triton.jit
def _kept_by_test(mass, count, top_p, top_k):
    """The candidate passes the test: the mass ranked before it is < top_p (1 keeps all), and fewer
    than top_k tokens lie strictly above it (0 keeps all), so it is at or above the k-th largest."""
    return ((top_p >= 1.0) | (mass < top_p)) & ((top_k <= 0) | (count < top_k))


@triton.jit
def _store_verdict(r, status, w, x_w, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr):
    tl.store(status_ptr + r, status)
    if status == 0:
        tl.store(sampled_ptr + r, w)
    elif status == 1:
        tl.store(bound_x_ptr + r, x_w)
        tl.store(bound_i_ptr + r, w)
    else:
        tl.store(candidate_ptr + r, w)


@triton.jit
def _pick_row(
    r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, sampled_ptr, status_ptr, bound_x_ptr,
    bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, part_score_ptr, part_index_ptr, part_max_ptr,
    part_sum_ptr, n_chunks, BLOCK_C: tl.constexpr, FIRST: tl.constexpr, ARGMAX: tl.constexpr,
    PRECISE: tl.constexpr, TOP_K: tl.constexpr,
):  # fmt: skip
    """Row r: the region's winner from the chunks (ties: lowest chunk, so lowest index), then the
    min-p test; returns the row's new status and (the first round, with top-k) how many chunk maxima
    lie above the winner. The first round also sets the row's max and logsumexp. Partials are read
    past L1: other SMs wrote them."""
    offs = tl.arange(0, BLOCK_C)
    m = offs < n_chunks
    scores = tl.load(part_score_ptr + r * n_chunks + offs, mask=m, other=float("-inf"), cache_modifier=".cg")
    w = tl.load(part_index_ptr + r * n_chunks + tl.argmax(scores, 0), cache_modifier=".cg")
    t = tl.load(temperature_ptr + r)
    status = tl.full([], 0, tl.int32)
    x_w = tl.full([], 0.0, tl.float32)
    above = tl.full([], 0, tl.int32)
    if not ARGMAX and t > 0.0:
        if FIRST:
            part_max = tl.load(
                part_max_ptr + r * n_chunks + offs, mask=m, other=float("-inf"), cache_modifier=".cg"
            )
            hi = tl.max(part_max, 0)
            tl.store(row_max_ptr + r, hi)
            if tl.load(top_p_ptr + r) < 1.0:  # the race wrote the sums only for top-p rows
                part_sum = tl.load(
                    part_sum_ptr + r * n_chunks + offs, mask=m, other=0.0, cache_modifier=".cg"
                )
                weighted = tl.where(m & (part_sum > 0.0), part_sum * _exp(part_max - hi, PRECISE), 0.0)
                tl.store(row_lse_ptr + r, hi + _log(tl.sum(weighted, 0), PRECISE))
            tl.store(bound_x_ptr + r, float("inf"))
            tl.store(bound_i_ptr + r, 9223372036854775807)
            row_max = hi
        else:
            row_max = tl.load(row_max_ptr + r)
        if tl.max(scores, 0) > float("-inf"):  # an empty region (NaN logits) keeps the winner
            x_w = scaled(tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + w), t, PRECISE)
            top_k = tl.zeros([], tl.int64)
            if TOP_K:
                top_k = tl.load(top_k_ptr + r)
            status = _verdict(x_w, row_max, tl.load(min_p_ptr + r), tl.load(top_p_ptr + r), top_k, PRECISE)
            if FIRST & TOP_K:
                above = tl.sum((part_max > x_w).to(tl.int32), 0)
    _store_verdict(r, status, w, x_w, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr)
    return status, above


@triton.jit
def _mass_chunk(
    r, c, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, candidate_ptr, row_max_ptr, row_lse_ptr,
    select_ptr, part_mass_ptr, part_count_ptr, part_hist_ptr, part_ref_ptr, V, n_chunks, CHUNK: tl.constexpr,
    PRECISE: tl.constexpr, TOP_K: tl.constexpr, BOTH: tl.constexpr,
):  # fmt: skip
    """Chunk c of row r under the test: for a top-p row the probability mass ranked before the
    candidate (MASS_PRECISION; the row's first pick set row_lse); with TOP_K, how many tokens lie
    strictly above it (top-k keeps every token at or above the k-th largest, ties included) and for a
    top-k row those tokens in CUT_BINS bins; with BOTH, for a row with top-k and top-p, the mass at or
    above the candidate instead, or once its select is known the top-k set's. The rank is by x / t,
    exactly rounded; the logits themselves rank the same except where rounding ties two of them, which
    only a logit within 2^-20 of the candidate's can."""
    row = logits_ptr + tl.cast(r, tl.int64) * stride
    t = tl.load(temperature_ptr + r)
    w = tl.load(candidate_ptr + r)
    raw_w = tl.load(row + w)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(row + idx, mask=inb, other=0.0)
    lse = tl.load(row_lse_ptr + r)
    close = inb & (raw != raw_w) & (tl.abs(raw - raw_w) <= TIE_BAND * tl.abs(raw_w))
    if (tl.max(close.to(tl.int32), 0) > 0) | ~(tl.abs(raw_w) < float("inf")):
        x = scaled(raw, t, PRECISE)
        x_w = scaled(raw_w, t, PRECISE)
        ahead = inb & _ahead(x, idx, x_w, w)
        above = inb & (x > x_w)
    else:
        ahead = inb & _ahead(raw, idx, raw_w, w)
        above = inb & (raw > raw_w)
    cut = False
    if TOP_K:
        tl.store(part_count_ptr + r * n_chunks + c, tl.sum(above.to(tl.int32), 0).to(tl.int64))
        top_k = tl.load(top_k_ptr + r)
        cut = top_k > 0
    both = False
    if BOTH:  # (top_k >= V with top-p: a top-p row, no cut)
        top_p = tl.load(top_p_ptr + r)
        both = _both(top_k, top_p, V)
        cut = cut & (top_p >= 1.0)
    if both:  # no cut: the mass of the top-k set (or at or above w, until the select is known)
        x = scaled(raw, t, PRECISE)
        ref = tl.where(
            _select_known(r, select_ptr), _threshold(r, select_ptr), _order_key(scaled(raw_w, t, PRECISE))
        )
        q = _mass_term(raw, t, lse)
        tl.store(part_ref_ptr + r * n_chunks + c, tl.sum(tl.where(inb & (_order_key(x) >= ref), q, 0.0), 0))
        tl.store(part_mass_ptr + r * n_chunks + c, tl.sum(tl.where(ahead, q, 0.0), 0))
    elif cut:  # top-k alone
        x = scaled(raw, t, PRECISE)
        x_w = scaled(raw_w, t, PRECISE)
        v = _cut_bin(x, x_w, _cut_scale(tl.load(row_max_ptr + r), x_w))
        b = tl.where(inb & (v >= 1.0), tl.minimum(v, CUT_BINS - 1.0), 0.0).to(tl.int32)  # NaN: 0
        bins = tl.arange(0, CUT_BINS)
        tl.store(part_hist_ptr + (r * n_chunks + c) * CUT_BINS + bins, tl.histogram(b, CUT_BINS))
        tl.store(part_mass_ptr + r * n_chunks + c, 0.0)
    else:
        q = tl.where(ahead, _mass_term(raw, t, lse), 0.0)
        tl.store(part_mass_ptr + r * n_chunks + c, tl.sum(q, 0))


@triton.jit
def _decide_row(
    r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, sampled_ptr, status_ptr, bound_x_ptr,
    bound_i_ptr, candidate_ptr, row_max_ptr, cut_ptr, select_ptr, part_mass_ptr, part_count_ptr, part_hist_ptr,
    part_ref_ptr, V, n_chunks, BLOCK_C: tl.constexpr, PRECISE: tl.constexpr, TOP_K: tl.constexpr,
    BOTH: tl.constexpr,
):  # fmt: skip
    """Row r under the test: keep the candidate if it passes top-p and top-k (status 0), else shrink
    the region to the tokens ranked before it (status 1), and for top-k to the highest of the test's
    bins that still hold top_k tokens; returns the status. A row with both: `_both_verdict`."""
    offs = tl.arange(0, BLOCK_C)
    part = tl.load(part_mass_ptr + r * n_chunks + offs, mask=offs < n_chunks, other=0.0, cache_modifier=".cg")
    w = tl.load(candidate_ptr + r)
    x_w = scaled(
        tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + w), tl.load(temperature_ptr + r), PRECISE
    )
    if TOP_K:
        top_k = tl.load(top_k_ptr + r)
        top_p = tl.load(top_p_ptr + r)
        count = tl.load(
            part_count_ptr + r * n_chunks + offs, mask=offs < n_chunks, other=0, cache_modifier=".cg"
        )
        kept = _kept_by_test(tl.sum(part, 0), tl.sum(count, 0), top_p, top_k)
        status = tl.where(kept, 0, 1)
        both = False
        if BOTH:
            both = _both(top_k, top_p, V)
        if both:
            status = _both_verdict(r, tl.sum(part, 0), tl.sum(count, 0), top_p, top_k, select_ptr, part_ref_ptr,
                                   n_chunks, BLOCK_C)  # fmt: skip
        elif (~kept) & (top_k > 0) & (top_p >= 1.0):  # top-k alone
            _cut_row(r, x_w, top_k, row_max_ptr, cut_ptr, part_hist_ptr, n_chunks, BLOCK_C)
    else:
        status = tl.where(_kept_by_test(tl.sum(part, 0), 0, tl.load(top_p_ptr + r), 0), 0, 1)
    _store_verdict(r, status, w, x_w, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr)
    return status


@triton.jit
def _both_verdict(r, mass, n_above, top_p, top_k, select_ptr, part_ref_ptr, n_chunks, BLOCK_C: tl.constexpr):
    """A row with top-k and top-p: its nucleus is normalised over the top-k set. A candidate in the
    set is kept below top_p of the mass at or above it (which the set holds) and rejected at top_p of
    the row's mass (which holds the set); with the set known, against the set's mass. Undecided, or
    outside the set before it is known: the select goes on (status 3), and the row tests again after."""
    offs = tl.arange(0, BLOCK_C)
    ref = tl.load(part_ref_ptr + r * n_chunks + offs, mask=offs < n_chunks, other=0.0, cache_modifier=".cg")
    in_set = n_above < top_k
    known = _select_known(r, select_ptr)
    kept = in_set & (mass < top_p * tl.sum(ref, 0))
    return tl.where(kept, 0, tl.where(known | (in_set & (mass >= top_p)), 1, 3))


@triton.jit
def _select_row(
    r, logits_ptr, stride, temperature_ptr, top_k_ptr, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr,
    candidate_ptr, select_ptr, select_hist_ptr, gather_ptr, PRECISE: tl.constexpr, GATHER_CAP: tl.constexpr,
):  # fmt: skip
    """A select pass of row r is done: its next status. 3 while the threshold is not known (or the
    row gathers next); then 2, the candidate's test, if it is in the top-k set, else 1, a race in the
    set (ranked before the candidate, as the whole set is)."""
    w = tl.load(candidate_ptr + r)
    x_w = scaled(
        tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + w), tl.load(temperature_ptr + r), PRECISE
    )
    status = tl.full([], 3, tl.int32)
    if _select_level(r, top_k_ptr, select_ptr, select_hist_ptr, gather_ptr, GATHER_CAP):
        status = tl.where(_order_key(x_w) >= _threshold(r, select_ptr), 2, 1)
    _store_verdict(r, status, w, x_w, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr)
    return status


@triton.jit
def _cut_row(r, x_w, top_k, row_max_ptr, cut_ptr, part_hist_ptr, n_chunks, BLOCK_C: tl.constexpr):
    """A rejected top-k winner w: cut the region to bins j and up of its test, for the highest j
    whose bins still hold top_k tokens. Every bin from 1 up lies above w, so the cut is inside the
    region ahead of w; with no such j the region stays that one."""
    offs = tl.arange(0, BLOCK_C)
    bins = tl.arange(0, CUT_BINS)
    # One load of every chunk's bins: a loop over the chunks was 5 µs slower a flat top_k 50 row.
    part = tl.load(
        part_hist_ptr + (r * n_chunks + offs[:, None]) * CUT_BINS + bins[None, :],
        mask=(offs < n_chunks)[:, None], other=0, cache_modifier=".cg",
    )  # fmt: skip
    hist = tl.sum(part, 0)
    from_bin = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # tokens in bins b and up
    j = tl.sum(((bins >= 1) & (from_bin >= top_k)).to(tl.int32), 0)
    if j > 0:
        tl.store(cut_ptr + r * 3, x_w)
        tl.store(cut_ptr + r * 3 + 1, _cut_scale(tl.load(row_max_ptr + r), x_w))
        tl.store(cut_ptr + r * 3 + 2, j.to(tl.float32))


def _persistent(items: int, programs: int) -> int:
    return max(1, min(items, programs))


def argmax_rows(logits: torch.Tensor, n_rows: torch.Tensor, state: RejectionRows, sampled: torch.Tensor, *,
                chunk: int, programs: int) -> None:  # fmt: skip
    """sampled[r] = argmax of logits row r (ties: lowest index) for r < n_rows: chunked, so one row
    reads at full bandwidth, and rows past n_rows cost nothing. One launch. Capturable."""
    S, V = logits.shape
    C = state.part_score.shape[1]
    _argmax_kernel[(_persistent(S * C, programs),)](
        logits, logits.stride(0), n_rows, sampled, state.status, state.part_score, state.part_index,
        state.arrived, V, C, CHUNK=chunk, BLOCK_C=triton.next_power_of_2(C), num_warps=4,
    )  # fmt: skip
