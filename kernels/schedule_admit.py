"""Schedule's admission of waiting slots (Scheduler.schedule phase 3), and the sample rows every
part of the batch writes. Part of the schedule program (kernels/schedule.py); build_batch in
schedule_batch.py calls admit_waiting once the running sequences have their chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import acquire_prefix, lookup_prefix, release_lanes, take_blocks
from blink_appliance.kernels.sampling import (
    SAMPLER_GREEDY,
    SAMPLER_LOGPROBS,
    SAMPLER_PENALTIES,
    SAMPLER_REJECTION,
    SAMPLER_REJECTION_TOP_K,
    SAMPLER_REJECTION_TOP_K_TOP_P,
)

_SAMPLER_GREEDY = tl.constexpr(SAMPLER_GREEDY)
_SAMPLER_REJECTION = tl.constexpr(SAMPLER_REJECTION)
_SAMPLER_REJECTION_TOP_K = tl.constexpr(SAMPLER_REJECTION_TOP_K)
_SAMPLER_REJECTION_TOP_K_TOP_P = tl.constexpr(SAMPLER_REJECTION_TOP_K_TOP_P)
_SAMPLER_LOGPROBS = tl.constexpr(SAMPLER_LOGPROBS)
_SAMPLER_PENALTIES = tl.constexpr(SAMPLER_PENALTIES)
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def admit_waiting(
    budget, top, head, tail, n_cached, next_run_order, st, md, m, n_preempted, clock, scoring,
    ms, ks, ntok_k, ncomp_k, n_k, nb_k, pre_k, rp_k, free_blocks_ptr, slots, blocks, step,
    S: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_J: tl.constexpr, AGING: tl.constexpr, LIMIT: tl.constexpr, SCORE: tl.constexpr, PBS: tl.constexpr,
    C: tl.constexpr, Q: tl.constexpr, HSTRIDE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HASH: tl.constexpr,
    SLOT: tl.constexpr,
):  # fmt: skip
    """Admission of waiting slots (Scheduler.schedule phases 3 and 6), only in a step whose budget
    fill preempted nothing: the head of the (effective priority, arrival) order while it fits (a
    sequence slot, budget, capacity for its chunk's blocks beyond its cached prefix and for the
    cached blocks it takes that nobody holds); else, if the last running sequence in running order is
    of a strictly lower class, that one is preempted (its chunk taken back) and the head tried again.
    Stops at a head that still does not fit, that this step preempted, that the class cap holds back,
    or that scores its prompt while another sequence does (`scoring`). m: running sequences. Admitted
    slots join the batch after the running ones. Returns (n_k, nb_k, pre_k, top,
    head, tail, n_cached, next_run_order, how many it preempted, (admitted sequences, their tokens,
    their sample rows, the sampler variant they need), prefix cache tokens looked up and found)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    waiting = md & (st == SLOT.WAITING)
    n_waiting = tl.sum(waiting.to(tl.int32), 0)
    n_new = tl.full([], 0, tl.int32)
    n_victims = tl.full([], 0, tl.int32)
    ntot_adm = tl.full([], 0, tl.int32)
    nsamp_adm = tl.full([], 0, tl.int32)
    sampler_index = tl.full([], 0, tl.int32)
    n_queried = tl.full([], 0, tl.int32)
    n_hit = tl.full([], 0, tl.int32)
    # Nothing waits, or the budget fill preempted (the common decode step): no slot-wide work below.
    if (n_preempted == 0) & (n_waiting > 0):
        pri_d = tl.load(slots.priority + offs_d, mask=md, other=0)
        live = md & ((st == SLOT.WAITING) | (st == SLOT.RUNNING))
        eff_d = _effective_priority(pri_d, live, waiting, clock, offs_d, slots, AGING)
        last_class = _last_class(ms, pre_k, rp_k, offs_s)
        w_best = tl.min(tl.where(waiting, eff_d, _INT64_MAX), 0)
        go = ((m < S) & (budget > 0)) | (last_class > w_best)
        if go:
            arr_d = tl.load(slots.arrival + offs_d, mask=md, other=0)
            ntok_d = tl.load(slots.num_tokens + offs_d, mask=md, other=0)
            nh_d = tl.load(slots.n_hashes + offs_d, mask=md, other=0)
            scores_d = md & (
                tl.load(slots.lp_next + offs_d, mask=md, other=0)
                < tl.load(slots.prompt_len + offs_d, mask=md, other=0)
            )
            adm_rank = tl.full([BLOCK_D], -1, tl.int32)
            adm_n = tl.zeros([BLOCK_D], tl.int32)
            adm_hits = tl.zeros([BLOCK_D], tl.int32)  # blocks of its cached prefix
            adm_need = tl.zeros([BLOCK_D], tl.int32)
            adm_off = tl.zeros([BLOCK_D], tl.int32)
            adm_qs = tl.zeros([BLOCK_D], tl.int32)
            adm_row = tl.full([BLOCK_D], -1, tl.int32)
            adm_eff = tl.zeros([BLOCK_D], tl.int64)
            victims_d = offs_d < 0  # slots this step preempted (WAITING again, not readmitted now)
            popped = tl.full([], 0, tl.int32)  # blocks of admissions not yet popped (pops are deferred)
            n_flushed = tl.full([], 0, tl.int32)  # admissions whose blocks are popped
            while go:
                cand = waiting | victims_d
                w_pri = tl.min(tl.where(cand, eff_d, _INT64_MAX), 0)
                w_cand = cand & (eff_d == w_pri)
                w_arr = tl.min(tl.where(w_cand, arr_d, _INT64_MAX), 0)
                w_slot = tl.min(tl.where(w_cand & (arr_d == w_arr), offs_d, BLOCK_D), 0)
                w_is = offs_d == w_slot
                w_again = tl.sum((w_is & victims_d).to(tl.int32), 0) > 0
                w_rem = tl.sum(
                    tl.where(w_is, ntok_d, 0), 0
                )  # all its tokens: a waiting slot has none computed
                w_scores = tl.sum((w_is & scores_d).to(tl.int32), 0) > 0
                w_hits = tl.full([], 0, tl.int32)
                w_revived = tl.full([], 0, tl.int32)
                if PBS > 0:  # its cached prefix (Scheduler._cached_prefix); none while it scores
                    limit = tl.where(
                        w_scores, 0, tl.minimum(tl.sum(tl.where(w_is, nh_d, 0), 0), (w_rem - 1) // BS)
                    )
                    w_hits, w_revived = lookup_prefix(
                        slots.prefix_hash + w_slot * HSTRIDE, limit, blocks, C, BLOCK_HASH
                    )
                w_n = tl.minimum(tl.where(w_scores, tl.minimum(w_rem, SCORE), w_rem - w_hits * BS), budget)
                w_need = (w_hits * BS + w_n + BS - 1) // BS - w_hits
                free = top + n_cached - popped
                room = (m - n_victims + n_new < S) & (budget > 0) & (w_need + w_revived <= free)
                held = (
                    w_again
                    | _class_capped(w_pri, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT)
                    | (scoring & w_scores)
                )
                w_fits = room & ~held
                evict = ~held & ~room & (_last_class(ms, pre_k, rp_k, offs_s) > w_pri)
                w_take = w_is & w_fits
                w_samples = w_fits & (w_hits * BS + w_n == w_rem)
                if PBS > 0:
                    if w_fits:  # it takes hold of its cached prefix now, before anything evicts it
                        acquire_prefix(slots.prefix_hash + w_slot * HSTRIDE, w_hits, w_slot, slots.block_table,
                                       blocks, MAXB, C, BLOCK_HASH)  # fmt: skip
                        n_cached -= w_revived
                        n_queried += w_rem
                        n_hit += w_hits * BS
                adm_rank = tl.where(w_take, n_new, adm_rank)
                adm_n = tl.where(w_take, w_n, adm_n)
                adm_hits = tl.where(w_take, w_hits, adm_hits)
                adm_need = tl.where(w_take, w_need, adm_need)
                adm_off = tl.where(w_take, popped, adm_off)
                adm_qs = tl.where(w_take, ntot_adm, adm_qs)
                adm_row = tl.where(w_take & w_samples, nsamp_adm, adm_row)
                adm_eff = tl.where(w_take, w_pri, adm_eff)
                f = w_fits.to(tl.int32)
                popped += w_need * f
                budget -= w_n * f
                ntot_adm += w_n * f
                nsamp_adm += w_samples.to(tl.int32)
                n_new += f
                scoring = scoring | (w_fits & w_scores)
                waiting = waiting & ~w_take
                go = evict | (w_fits & (tl.sum(waiting.to(tl.int32), 0) > 0))
                # The admissions' blocks come off the free list before a victim's go on it, and with
                # the cache before the next head looks up (its allocation may evict what it would hit).
                flush = evict | ~go
                if PBS > 0:
                    flush = flush | w_fits
                if flush:
                    tl.debug_barrier()
                    pend = adm_rank >= n_flushed
                    top, head, n_cached = take_blocks(
                        pend, adm_need, adm_off, offs_d, adm_hits, top, head, tail, n_cached, slots.block_table,
                        free_blocks_ptr, blocks, MAXB, BLOCK_J, C, Q, BLOCK_L,
                    )  # fmt: skip
                    popped -= popped
                    n_flushed = n_new
                if evict:
                    v_k = tl.max(tl.where(ms & (pre_k == 0), offs_s, -1), 0)
                    is_v = offs_s == v_k
                    v_slot = tl.sum(tl.where(is_v, ks, 0), 0)
                    top, tail, n_cached = release_lanes(is_v, offs_s, ks, nb_k, top, tail, n_cached, slots.block_table,
                                                        free_blocks_ptr, blocks, MAXB, BLOCK_J, Q)  # fmt: skip
                    budget += tl.sum(tl.where(is_v, n_k, 0), 0)
                    n_k = tl.where(is_v, 0, n_k)
                    nb_k = tl.where(is_v, 0, nb_k)
                    pre_k = tl.where(is_v, 1, pre_k)
                    n_victims += 1
                    victims_d = victims_d | (offs_d == v_slot)
                    eff_d = tl.where(offs_d == v_slot, pri_d.to(tl.int64), eff_d)  # back at its base priority
            n_k = _take_back_held(n_k, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT)
            next_run_order, sampler_index = _store_admitted(
                adm_rank, adm_n, adm_hits, adm_need, adm_qs, adm_row, adm_eff, next_run_order, n_new,
                ms, ntok_k, ncomp_k, n_k, offs_d, slots, step, BS, SLOT,
            )  # fmt: skip
    new = (n_new, ntot_adm, nsamp_adm, sampler_index)
    return n_k, nb_k, pre_k, top, head, tail, n_cached, next_run_order, n_victims, new, n_queried, n_hit


@triton.jit
def _store_admitted(
    adm_rank, adm_n, adm_hits, adm_need, adm_qs, adm_row, adm_eff, next_run_order, n_new,
    ms, ntok_k, ncomp_k, n_k, offs_d, slots, step, BS: tl.constexpr, SLOT: tl.constexpr,
):  # fmt: skip
    """The admitted slots' state, and their part of the batch after the running ones that kept a
    chunk. Returns (next_run_order, the sampler variant their rows need)."""
    adm = adm_rank >= 0
    cached = adm_hits * BS
    tl.store(slots.slot_state + offs_d, tl.full(offs_d.shape, SLOT.RUNNING, tl.int32), mask=adm)
    tl.store(slots.run_order + offs_d, next_run_order + adm_rank, mask=adm)
    tl.store(slots.run_priority + offs_d, adm_eff.to(tl.int32), mask=adm)
    tl.store(slots.num_computed + offs_d, cached + adm_n, mask=adm)
    tl.store(slots.num_blocks + offs_d, adm_hits + adm_need, mask=adm)
    sched_k = ms & (n_k > 0)
    nseq_run = tl.sum(sched_k.to(tl.int32), 0)
    ntot_run = tl.sum(tl.where(sched_k, n_k, 0), 0)
    nsamp_run = tl.sum((sched_k & (ncomp_k + n_k == ntok_k)).to(tl.int32), 0)
    bi_d = nseq_run + adm_rank
    tl.store(step.step_slot + bi_d, offs_d, mask=adm)
    tl.store(step.step_chunk + bi_d, adm_n, mask=adm)
    tl.store(step.query_start + bi_d, ntot_run + adm_qs, mask=adm)
    tl.store(step.context_lens + bi_d, cached + adm_n, mask=adm)
    sampler_index = write_sample_rows(
        adm_row >= 0, nsamp_run + adm_row, offs_d, (ntot_run + adm_qs + adm_n - 1).to(tl.int64), slots, step
    )
    return next_run_order + n_new, sampler_index


@triton.jit
def _effective_priority(pri_d, live, waiting, clock, offs_d, slots, AGING: tl.constexpr):
    """Each waiting slot's priority now (int64): one better per AGING steps waited since wait_since,
    never better than the most urgent base priority of the live slots; the base one without aging."""
    eff = pri_d.to(tl.int64)
    if AGING > 0:
        since = tl.load(slots.wait_since + offs_d, mask=waiting, other=0)
        floor = tl.min(tl.where(live, pri_d, _INT32_MAX), 0).to(tl.int64)
        eff = tl.maximum(floor, eff - (clock - since) // AGING)
    return eff


@triton.jit
def _class_capped(w_pri, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT: tl.constexpr):
    """Scheduler._capped: with LIMIT >= 0, a head of effective priority w_pri is held back when it is
    of a class below the most urgent running one (this step's admissions counted) while LIMIT running
    sequences already are (held ones counted)."""
    capped = w_pri < w_pri
    if LIMIT >= 0:
        kept = ms & (pre_k == 0)
        adm = adm_rank >= 0
        top_class = _top_class(kept, rp_k, adm, adm_eff)
        n_lower = tl.sum((kept & (rp_k.to(tl.int64) > top_class)).to(tl.int32), 0) + tl.sum(
            (adm & (adm_eff > top_class)).to(tl.int32), 0
        )
        capped = (w_pri > top_class) & (n_lower >= LIMIT)
    return capped


@triton.jit
def _take_back_held(n_k, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT: tl.constexpr):
    """The end of Scheduler phase 3: with LIMIT >= 0, the running sequences the class cap holds once
    this step's admissions count (of a class below the most urgent one, beyond the first LIMIT in
    run order) give their chunk back; the blocks it took stay theirs. Admissions never are among
    them: a lower-class head is admitted only while fewer than LIMIT such sequences run."""
    if LIMIT >= 0:
        kept = ms & (pre_k == 0)
        lower = kept & (rp_k.to(tl.int64) > _top_class(kept, rp_k, adm_rank >= 0, adm_eff))
        rank = tl.cumsum(lower.to(tl.int32), 0) - lower.to(tl.int32)
        n_k = tl.where(lower & (rank >= LIMIT), 0, n_k)
    return n_k


@triton.jit
def _top_class(kept, rp_k, adm, adm_eff):
    """The most urgent class (int64) among the running lanes kept and this step's admissions."""
    return tl.minimum(
        tl.min(tl.where(kept, rp_k.to(tl.int64), _INT64_MAX), 0),
        tl.min(tl.where(adm, adm_eff, _INT64_MAX), 0),
    )


@triton.jit
def _last_class(ms, pre_k, rp_k, offs_s):
    """The class (run_priority, int64) of the last running sequence in running order not preempted;
    below every priority when there is none (nothing to preempt)."""
    k = tl.max(tl.where(ms & (pre_k == 0), offs_s, -1), 0)
    return tl.where(k >= 0, tl.sum(tl.where(offs_s == k, rp_k, 0), 0).to(tl.int64), -_INT64_MAX)


@triton.jit
def either_sampler(a, b):
    """The variant that serves the rows of both: the larger base variant, and the logprob and
    penalty parts of either (kernels/sampling.py: base + SAMPLER_LOGPROBS * (logprobs + 2 penalties))."""
    base = tl.maximum(a % _SAMPLER_LOGPROBS, b % _SAMPLER_LOGPROBS)
    return base + _SAMPLER_LOGPROBS * ((a // _SAMPLER_LOGPROBS) | (b // _SAMPLER_LOGPROBS))


@triton.jit
def write_sample_rows(samples, row, slot, logits_row, slots, step):
    """Sample row `row` of each sampling sequence: which slot, which token row of the step, and the
    slot's sampling parameters gathered so the sampler reads rows directly. Returns the sampler
    variant the rows need (kernels/sampling.py SAMPLER_*: ordered so the larger serves them all)."""
    temperature = tl.load(slots.temperature + slot, mask=samples, other=0.0)
    top_k = tl.load(slots.top_k + slot, mask=samples, other=0)
    tl.store(step.sample_slot + row, slot, mask=samples)
    tl.store(step.sample_rows + row, logits_row, mask=samples)
    tl.store(step.row_temperature + row, temperature, mask=samples)
    tl.store(step.row_top_k + row, top_k.to(tl.int64), mask=samples)
    tl.store(step.row_top_p + row, tl.load(slots.top_p + slot, mask=samples, other=1.0), mask=samples)
    tl.store(step.row_min_p + row, tl.load(slots.min_p + slot, mask=samples, other=0.0), mask=samples)
    tl.store(step.row_seed + row, tl.load(slots.seed + slot, mask=samples, other=0), mask=samples)
    generated = tl.load(slots.num_tokens + slot, mask=samples, other=0) - tl.load(
        slots.prompt_len + slot, mask=samples, other=0
    )
    tl.store(step.row_output_index + row, generated.to(tl.int64), mask=samples)
    random = samples & (temperature > 0.0)
    nucleus = tl.load(slots.top_p + slot, mask=samples, other=1.0) < 1.0
    with_top_k = tl.where(nucleus, _SAMPLER_REJECTION_TOP_K_TOP_P, _SAMPLER_REJECTION_TOP_K)
    need = tl.where(random, tl.where(top_k > 0, with_top_k, _SAMPLER_REJECTION), _SAMPLER_GREEDY)
    logprobs = samples & (tl.load(slots.lp_top_n + slot, mask=samples, other=-1) >= 0)
    # The penalties' variants also mask constrained rows (engine/loop/constraint.py).
    penalized = samples & (
        (tl.load(slots.penalized + slot, mask=samples, other=0) != 0)
        | (tl.load(slots.c_offset + slot, mask=samples, other=-1) >= 0)
    )
    return (
        tl.max(need, 0)
        + _SAMPLER_LOGPROBS * tl.max(logprobs.to(tl.int32), 0)
        + _SAMPLER_PENALTIES * tl.max(penalized.to(tl.int32), 0)
    )
