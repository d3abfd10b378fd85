"""The rejection variant's finisher: the rows still undecided after the chunked rounds
(kernels/sampling_rounds.py), one program per row, exact however many races the row takes."""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.sampling import _exp, _min_p_floor, gumbel, scaled
from blink_appliance.kernels.sampling_gather import GATHERED, _gather_row
from blink_appliance.kernels.sampling_rejection import _ahead, _both, _kept_by_test, _verdict
from blink_appliance.kernels.sampling_select import _kth_key, _order_key, _select_known, _threshold

FINISH_CAP = 4096  # iterations of `finish` before it takes the row's first token (always kept)


@triton.jit
def _finish_kernel(
    logits_ptr, stride, n_rows_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr,
    sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, select_ptr,
    gather_ptr, gathered_ptr, V, BLOCK: tl.constexpr, CAP: tl.constexpr, PRECISE: tl.constexpr, BOTH: tl.constexpr,
    GATHER_CAP: tl.constexpr = 0,
):  # fmt: skip
    """One program per row still undecided: race and test over the whole row until a winner is kept.
    The row's state stays in registers; only the kept token is written. With BOTH, a row with top-k
    and top-p tests against its top-k set's mass, whose threshold it selects here if the passes had not.
    A top-k row whose passes gathered its candidates (GATHERED) is decided from them."""
    r = tl.program_id(0)
    status = tl.load(status_ptr + r, mask=r < tl.load(n_rows_ptr), other=0)  # rows past n_rows: stale
    if GATHER_CAP > 0:
        if status == GATHERED:
            w = _gather_row(
                r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr,
                row_max_ptr, row_lse_ptr, gather_ptr, gathered_ptr, GATHER_CAP, PRECISE,
            )  # fmt: skip
            tl.store(sampled_ptr + r, w)
            tl.store(status_ptr + r, 0)
            status = 0
    if status != 0:
        row = logits_ptr + tl.cast(r, tl.int64) * stride
        t = tl.load(temperature_ptr + r)
        top_p = tl.load(top_p_ptr + r)
        top_k = tl.load(top_k_ptr + r)
        min_p = tl.load(min_p_ptr + r)
        row_max = tl.load(row_max_ptr + r)
        floor = _min_p_floor(row_max, min_p, PRECISE)
        lse = tl.load(row_lse_ptr + r)
        seed = tl.load(seed_ptr + r)
        out_index = tl.load(out_index_ptr + r)
        bx = tl.load(bound_x_ptr + r)
        bi = tl.load(bound_i_ptr + r)
        w = tl.load(candidate_ptr + r)
        offs = tl.arange(0, BLOCK)
        both = False
        threshold = tl.zeros([], tl.uint32)
        if BOTH:
            both = _both(top_k, top_p, V)
            if both:
                threshold = _threshold(r, select_ptr)
                if ~_select_known(r, select_ptr):
                    threshold = _kth_key(row, t, V, top_k, BLOCK, PRECISE).to(tl.uint32)
        iters = 0
        while (status != 0) & (iters < CAP):
            if status == 1:
                best = tl.full([], float("-inf"), tl.float32)
                w = tl.full([], 0, tl.int64)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    inb = idx < V
                    x = scaled(tl.load(row + idx, mask=inb, other=0.0), t, PRECISE)
                    region = inb & _ahead(x, idx, bx, bi) & (x >= floor)
                    score = tl.where(region, gumbel(x, idx, seed, out_index, PRECISE), float("-inf"))
                    chunk_best = tl.max(score, 0)
                    better = chunk_best > best  # strictly: an earlier chunk keeps a tie
                    w = tl.where(better, start + tl.argmax(score, 0).to(tl.int64), w)
                    best = tl.maximum(best, chunk_best)
                x_w = scaled(tl.load(row + w), t, PRECISE)
                status = tl.where(
                    best == float("-inf"), 0, _verdict(x_w, row_max, min_p, top_p, top_k, PRECISE)
                )
                bx = tl.where(status == 1, x_w, bx)
                bi = tl.where(status == 1, w, bi)
            else:
                x_w = scaled(tl.load(row + w), t, PRECISE)
                mass = tl.zeros([BLOCK], tl.float32)
                in_set = tl.zeros([BLOCK], tl.float32)  # the top-k set's mass, for `both`
                count = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    inb = idx < V
                    x = scaled(tl.load(row + idx, mask=inb, other=0.0), t, PRECISE)
                    q = _exp(x - lse, PRECISE)
                    mass += tl.where(inb & _ahead(x, idx, x_w, w), q, 0.0)
                    if both:
                        in_set += tl.where(inb & (_order_key(x) >= threshold), q, 0.0)
                    count += (inb & (x > x_w)).to(tl.int32)
                n_above, ahead = tl.sum(count, 0), tl.sum(mass, 0)
                kept = _kept_by_test(ahead, n_above, top_p, top_k)
                if both:  # the nucleus is the top-k set's, normalised over it
                    kept = (n_above < top_k) & (ahead < top_p * tl.sum(in_set, 0))
                status = tl.where(kept, 0, 1)
                bx = tl.where(status == 1, x_w, bx)
                bi = tl.where(status == 1, w, bi)
            iters += 1
        if status != 0:  # past the cap: the row's first token, which every filter keeps
            top = tl.full([], float("-inf"), tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = scaled(tl.load(row + idx, mask=idx < V, other=0.0), t, PRECISE)
                x = tl.where(idx < V, x, float("-inf"))
                better = tl.max(x, 0) > top
                w = tl.where(better, start + tl.argmax(x, 0).to(tl.int64), w)
                top = tl.maximum(top, tl.max(x, 0))
        tl.store(sampled_ptr + r, w)
        tl.store(status_ptr + r, 0)
