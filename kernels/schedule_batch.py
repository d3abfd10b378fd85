"""Schedule's batch: which sequences run this step and how many tokens each, as the reference
Scheduler.schedule picks them (with a class cap, the running ones of a lower class than the most
urgent running one beyond the cap preempted first; running sequences in (class, admission) order: decodes first, prefill
chunks in the rest of the token budget, KV blocks from the free stack, recompute preemption of the
last in that order; then admission of waiting slots in (effective priority, arrival) order, which
preempts running slots of a strictly lower class when the head does not fit), written into the step
tables and the sample rows.

Part of the schedule program (kernels/schedule.py): running sequences are put in run order once
(compaction + a rank over the running ones, through a small scratch buffer) and the budget fill is done in
vectorized rounds (prefix sums), one round per preemption event, so a step without preemption is
one round. The sequential part (admissions of waiting slots, and the preemptions they cause) loops
over registers with masked reductions; global memory is only touched to gather/scatter.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import acquire_prefix, lookup_prefix, release_lanes, take_blocks
from blink_appliance.kernels.sampling import (
    SAMPLER_FULL,
    SAMPLER_GREEDY,
    SAMPLER_LOGPROBS,
    SAMPLER_PENALTIES,
    SAMPLER_REJECTION,
)

_SAMPLER_GREEDY = tl.constexpr(SAMPLER_GREEDY)
_SAMPLER_REJECTION = tl.constexpr(SAMPLER_REJECTION)
_SAMPLER_FULL = tl.constexpr(SAMPLER_FULL)
_SAMPLER_LOGPROBS = tl.constexpr(SAMPLER_LOGPROBS)
_SAMPLER_PENALTIES = tl.constexpr(SAMPLER_PENALTIES)
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def build_batch(
    st, md, top, head, tail, n_cached, next_run_order, clock, offs_s, scratch_ptr, free_blocks_ptr, slots,
    blocks, step,
    S: tl.constexpr, MAX_BATCHED: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_RANK: tl.constexpr,
    AGING: tl.constexpr, LIMIT: tl.constexpr, PBS: tl.constexpr, C: tl.constexpr, Q: tl.constexpr,
    HSTRIDE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HASH: tl.constexpr, SLOT: tl.constexpr,
):  # fmt: skip
    """The step's batch (Scheduler.schedule): the class cap, running slots in running order get their
    chunks, then waiting slots are admitted; slot state, step tables and sample rows written. Returns
    (stack top, LRU head, tail and live count, next_run_order, sequences, tokens, sample rows, sampler
    variant, preemptions, prefix cache tokens looked up and found)."""
    m, ms, ks, ntok_k, ncomp_k, nb_k, rp_k = order_running(
        st, md, offs_s, scratch_ptr, slots, BLOCK_D, BLOCK_RANK, SLOT
    )
    m, pre_k, nb_k, top, tail, n_cached, n_capped = cap_lower_classes(
        m,
        ms,
        ks,
        nb_k,
        rp_k,
        top,
        tail,
        n_cached,
        offs_s,
        free_blocks_ptr,
        slots,
        blocks,
        MAXB,
        BLOCK_S,
        BLOCK_J,
        Q,
        LIMIT,
        SLOT,
    )  # fmt: skip  (m: the running ones it kept, the first m in running order)
    n_k, nb_k, pre_k, budget, top, head, tail, n_cached, n_preempted = fill_budget(
        top, head, tail, n_cached, m, ks, ntok_k, ncomp_k, nb_k, pre_k, offs_s, free_blocks_ptr, slots, blocks,
        MAX_BATCHED, BS, MAXB, BLOCK_S, BLOCK_J, C, Q, BLOCK_L,
    )  # fmt: skip
    n_k, nb_k, pre_k, top, head, tail, n_cached, next_run_order, n_victims, new, n_queried, n_hit = admit_waiting(
        budget, top, head, tail, n_cached, next_run_order, st, md, m, n_preempted, n_capped, clock,
        ms, ks, ntok_k, ncomp_k, n_k, nb_k, pre_k, rp_k, free_blocks_ptr, slots, blocks, step,
        S, BS, MAXB, BLOCK_D, BLOCK_S, BLOCK_J, AGING, LIMIT, PBS, C, Q, HSTRIDE, BLOCK_L, BLOCK_HASH, SLOT,
    )  # fmt: skip
    n_new, ntot_new, nsamp_new, sampler_new = new
    store_running(ms, ks, ncomp_k, n_k, nb_k, pre_k, clock, slots, SLOT)
    nseq, ntot, nsamp, sampler_index = write_running_batch(ks, ntok_k, ncomp_k, n_k, slots, step)
    sampler_index = _either_sampler(sampler_index, sampler_new)
    return (
        top,
        head,
        tail,
        n_cached,
        next_run_order,
        nseq + n_new,
        ntot + ntot_new,
        nsamp + nsamp_new,
        sampler_index,
        n_capped + n_preempted + n_victims,
        n_queried,
        n_hit,
    )


@triton.jit
def order_running(
    st, md, offs_s, scratch_ptr, slots, BLOCK_D: tl.constexpr, RANK_TILE: tl.constexpr, SLOT: tl.constexpr
):
    """Running slots in running order: compact them (slot order), rank by (run_priority, run_order),
    reorder. Returns (m running sequences, lanes k < m, the k-th one's slot, num_tokens, num_computed,
    num_blocks, run_priority)."""
    offs_d = tl.arange(0, BLOCK_D)
    running = md & (st == SLOT.RUNNING)
    running_i = running.to(tl.int32)
    m = tl.sum(running_i, 0)
    tl.store(scratch_ptr + tl.cumsum(running_i, 0) - running_i, offs_d, mask=running)
    tl.debug_barrier()
    ms = offs_s < m
    compact = tl.load(scratch_ptr + offs_s, mask=ms, other=0)
    ro = tl.load(slots.run_order + compact, mask=ms, other=0)
    rp = tl.load(slots.run_priority + compact, mask=ms, other=0)
    # The rank counts over the m running sequences only, a tile at a time: an S x S comparison
    # would cost max_seqs^2 every step whatever the batch.
    rank = tl.zeros_like(offs_s)
    for j0 in range(0, m, RANK_TILE):
        offs_j = j0 + tl.arange(0, RANK_TILE)
        mj = offs_j < m
        slot_j = tl.load(scratch_ptr + offs_j, mask=mj, other=0)
        ro_j = tl.load(slots.run_order + slot_j, mask=mj, other=0)
        rp_j = tl.load(slots.run_priority + slot_j, mask=mj, other=0)
        before = (rp_j[None, :] < rp[:, None]) | (
            (rp_j[None, :] == rp[:, None]) & (ro_j[None, :] < ro[:, None])
        )
        rank += tl.sum((mj[None, :] & before).to(tl.int32), 1)
    tl.store(scratch_ptr + BLOCK_D + rank, compact, mask=ms)
    tl.debug_barrier()
    ks = tl.load(scratch_ptr + BLOCK_D + offs_s, mask=ms, other=0)  # slot of the k-th running sequence
    ntok_k = tl.load(slots.num_tokens + ks, mask=ms, other=0)
    ncomp_k = tl.load(slots.num_computed + ks, mask=ms, other=0)
    nb_k = tl.load(slots.num_blocks + ks, mask=ms, other=0)
    rp_k = tl.load(slots.run_priority + ks, mask=ms, other=0)
    return m, ms, ks, ntok_k, ncomp_k, nb_k, rp_k


@triton.jit
def cap_lower_classes(
    m, ms, ks, nb_k, rp_k, top, tail, n_cached, offs_s, free_blocks_ptr, slots, blocks,
    MAXB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, Q: tl.constexpr, LIMIT: tl.constexpr,
    SLOT: tl.constexpr,
):  # fmt: skip
    """Phase 0 (Scheduler._cap_lower_classes): with LIMIT > 0, the running sequences of a class below
    the most urgent running one beyond LIMIT are preempted, the last in running order first: the
    tail of the run order lets go of its blocks from the last one on. Their slot state is WAITING from
    here on (admit_waiting reads it back; store_running writes the rest). Returns (the running ones
    kept, the first in run order, the preempted flags, blocks held, top, tail, n_cached, how many)."""
    pre_k = tl.zeros([BLOCK_S], tl.int32)
    n_capped = tl.full([], 0, tl.int32)
    if LIMIT > 0:
        top_class = tl.min(tl.where(ms, rp_k, _INT32_MAX), 0)
        n_lower = tl.sum((ms & (rp_k > top_class)).to(tl.int32), 0)
        n_capped = tl.maximum(n_lower - LIMIT, 0)
        if n_capped > 0:
            victim = ms & (offs_s >= m - n_capped)
            top, tail, n_cached = release_lanes(victim, offs_s, ks, nb_k, top, tail, n_cached, slots.block_table,
                                                free_blocks_ptr, blocks, MAXB, BLOCK_J, Q, True)  # fmt: skip
            pre_k = tl.where(victim, 1, pre_k)
            nb_k = tl.where(victim, 0, nb_k)
            tl.store(slots.slot_state + ks, tl.full([BLOCK_S], SLOT.WAITING, tl.int32), mask=victim)
            tl.debug_barrier()  # the states are visible before the fill pops blocks
    return m - n_capped, pre_k, nb_k, top, tail, n_cached, n_capped


@triton.jit
def fill_budget(
    top, head, tail, n_cached, m, ks, ntok_k, ncomp_k, nb_k, pre_k, offs_s, free_blocks_ptr, slots, blocks,
    MAX_BATCHED: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_J: tl.constexpr, C: tl.constexpr, Q: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """The budget fill (Scheduler.schedule phases 1-2) of the first m running sequences in run order
    (those the class cap kept), in rounds (store_running stores the outcome once admission is done).
    Returns (each one's chunk, blocks held and preempted flag, the budget left, top, head, tail,
    n_cached, how many it preempted).

    A round schedules sequences i0..hi as if no preemption happened: decodes 1 token, prefills
    greedily from what the budget leaves after one token per decode (= the reference's `reserved`),
    blocks from the free stack and then the LRU, by prefix sums. The first sequence whose blocks do
    not fit ends the round: the sequences before it keep their chunks, the most recent ones (from hi
    down) are preempted one by one until it fits or it is itself the victim (a victim frees only the
    blocks nobody else holds), and the next round starts after it."""
    block_table_ptr = slots.block_table
    rem_k = ntok_k - ncomp_k
    n_k = tl.zeros([BLOCK_S], tl.int32)
    zeros = tl.zeros([BLOCK_S], tl.int32)
    budget = tl.full([], MAX_BATCHED, tl.int32)
    i0 = tl.full([], 0, tl.int32)
    hi = m - 1
    while i0 <= hi:
        act = (offs_s >= i0) & (offs_s <= hi)
        dec = act & (rem_k == 1)
        pref = act & (rem_k != 1)
        prefill_budget = budget - tl.sum(dec.to(tl.int32), 0)
        prem = tl.where(pref, rem_k, 0)
        wanted_before = tl.cumsum(prem, 0) - prem  # by the round's earlier prefills
        n = tl.where(
            dec, 1, tl.where(pref, tl.minimum(tl.maximum(prefill_budget - wanted_before, 0), rem_k), 0)
        )
        need = tl.where(n > 0, (ncomp_k + n + BS - 1) // BS - nb_k, 0)
        cum_need = tl.cumsum(need, 0)
        kstar = tl.min(tl.where(act & (cum_need > top + n_cached), offs_s, BLOCK_S), 0)
        ok = act & (offs_s < kstar)
        top, head, n_cached = take_blocks(ok, need, cum_need - need, ks, nb_k, top, head, tail, n_cached,
                                          block_table_ptr, free_blocks_ptr, blocks, MAXB, BLOCK_J, C, Q, BLOCK_L)  # fmt: skip
        budget -= tl.sum(tl.where(ok, n, 0), 0)
        n_k = tl.where(ok, n, n_k)
        nb_k = tl.where(ok, nb_k + need, nb_k)
        if kstar < BLOCK_S:
            is_k = offs_s == kstar
            need_k = tl.sum(tl.where(is_k, need, 0), 0)
            n_star = tl.sum(tl.where(is_k, n, 0), 0)
            v = hi
            while (v > kstar) & (top + n_cached < need_k):
                is_v = offs_s == v
                top, tail, n_cached = release_lanes(is_v, offs_s, ks, nb_k, top, tail, n_cached, block_table_ptr,
                                                    free_blocks_ptr, blocks, MAXB, BLOCK_J, Q, False)  # fmt: skip
                pre_k = tl.where(is_v, 1, pre_k)
                nb_k = tl.where(is_v, 0, nb_k)
                v -= 1
            survives = top + n_cached >= need_k
            if top + n_cached < need_k:  # it is the victim itself
                top, tail, n_cached = release_lanes(is_k, offs_s, ks, nb_k, top, tail, n_cached, block_table_ptr,
                                                    free_blocks_ptr, blocks, MAXB, BLOCK_J, Q, False)  # fmt: skip
                pre_k = tl.where(is_k, 1, pre_k)
                nb_k = tl.where(is_k, 0, nb_k)
            take = is_k & survives
            top, head, n_cached = take_blocks(take, need, zeros, ks, nb_k, top, head, tail, n_cached,
                                              block_table_ptr, free_blocks_ptr, blocks, MAXB, BLOCK_J, C, Q, BLOCK_L)  # fmt: skip
            budget -= tl.where(survives, n_star, 0)
            n_k = tl.where(take, n, n_k)
            nb_k = tl.where(take, nb_k + need, nb_k)
            hi = tl.where(survives, v, kstar - 1)
            i0 = kstar + 1
        else:
            i0 = hi + 1
    n_preempted = tl.sum(((pre_k != 0) & (offs_s < m)).to(tl.int32), 0)
    return n_k, nb_k, pre_k, budget, top, head, tail, n_cached, n_preempted


@triton.jit
def store_running(ms, ks, ncomp_k, n_k, nb_k, pre_k, clock, slots, SLOT: tl.constexpr):
    """The running sequences' outcome of the step: num_computed advanced by their chunk, blocks held,
    RUNNING; or, preempted (by the budget fill or by admission), WAITING since `clock` with none."""
    preempted = ms & (pre_k != 0)
    tl.store(slots.num_computed + ks, tl.where(preempted, 0, ncomp_k + n_k), mask=ms)
    tl.store(slots.num_blocks + ks, nb_k, mask=ms)
    tl.store(slots.slot_state + ks, tl.where(preempted, SLOT.WAITING, SLOT.RUNNING), mask=ms)
    tl.store(slots.wait_since + ks, tl.zeros_like(ks).to(tl.int64) + clock, mask=preempted)


@triton.jit
def write_running_batch(ks, ntok_k, ncomp_k, n_k, slots, step):
    """The running part of the batch, in run order: step tables and sample rows of the sequences
    with a chunk. Returns (sequences, tokens, sample rows, the sampler variant they need)."""
    sched_k = n_k > 0
    bi_k = tl.cumsum(sched_k.to(tl.int32), 0) - sched_k.to(tl.int32)
    qs_k = tl.cumsum(n_k, 0) - n_k
    samples_k = sched_k & (ncomp_k + n_k == ntok_k)
    row_k = tl.cumsum(samples_k.to(tl.int32), 0) - samples_k.to(tl.int32)
    nseq = tl.sum(sched_k.to(tl.int32), 0)
    ntot = tl.sum(n_k, 0)
    nsamp = tl.sum(samples_k.to(tl.int32), 0)
    tl.store(step.step_slot + bi_k, ks, mask=sched_k)
    tl.store(step.step_chunk + bi_k, n_k, mask=sched_k)
    tl.store(step.query_start + bi_k, qs_k, mask=sched_k)
    tl.store(step.context_lens + bi_k, ncomp_k + n_k, mask=sched_k)
    sampler_index = _write_sample_rows(samples_k, row_k, ks, (qs_k + n_k - 1).to(tl.int64), slots, step)
    return nseq, ntot, nsamp, sampler_index


@triton.jit
def admit_waiting(
    budget, top, head, tail, n_cached, next_run_order, st, md, m, n_preempted, n_capped, clock,
    ms, ks, ntok_k, ncomp_k, n_k, nb_k, pre_k, rp_k, free_blocks_ptr, slots, blocks, step,
    S: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_J: tl.constexpr, AGING: tl.constexpr, LIMIT: tl.constexpr, PBS: tl.constexpr, C: tl.constexpr,
    Q: tl.constexpr, HSTRIDE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HASH: tl.constexpr,
    SLOT: tl.constexpr,
):  # fmt: skip
    """Admission of waiting slots (Scheduler.schedule phase 3), only in a step whose budget fill
    preempted nothing: the head of the (effective priority, arrival) order while it fits (a sequence
    slot, budget, free capacity for its chunk's blocks beyond its cached prefix and for the cached
    blocks it takes that nobody holds); when it does not and the last running sequence in running
    order is of a strictly lower class, that one is preempted (its chunk of this step taken back) and
    the head tried again. Stops at a head that still does not fit, that this step preempted (class
    cap, admission), or that the class cap holds back (_class_capped). m: running sequences the
    class cap kept. Admitted slots join the batch after the running ones (written here). Returns (n_k,
    nb_k, pre_k after its preemptions, top, head, tail, n_cached, next_run_order, how many it
    preempted, (admitted sequences, their tokens, their sample rows, the sampler variant they need),
    prefix cache tokens looked up and found)."""
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
            adm_rank = tl.full([BLOCK_D], -1, tl.int32)
            adm_n = tl.zeros([BLOCK_D], tl.int32)
            adm_hits = tl.zeros([BLOCK_D], tl.int32)  # blocks of its cached prefix
            adm_need = tl.zeros([BLOCK_D], tl.int32)
            adm_off = tl.zeros([BLOCK_D], tl.int32)
            adm_qs = tl.zeros([BLOCK_D], tl.int32)
            adm_row = tl.full([BLOCK_D], -1, tl.int32)
            adm_eff = tl.zeros([BLOCK_D], tl.int64)
            # Slots this step preempted (WAITING again, not readmitted now), at their base priority.
            victims_d = _capped_slots(st, md, n_capped, offs_d, slots, LIMIT, SLOT)
            eff_d = tl.where(victims_d, pri_d.to(tl.int64), eff_d)
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
                w_hits = tl.full([], 0, tl.int32)
                w_revived = tl.full([], 0, tl.int32)
                if PBS > 0:  # its cached prefix (Scheduler._cached_prefix)
                    limit = tl.minimum(tl.sum(tl.where(w_is, nh_d, 0), 0), (w_rem - 1) // BS)
                    w_hits, w_revived = lookup_prefix(
                        slots.prefix_hash + w_slot * HSTRIDE, limit, blocks, C, BLOCK_HASH
                    )
                w_n = tl.minimum(w_rem - w_hits * BS, budget)
                w_need = (w_hits * BS + w_n + BS - 1) // BS - w_hits
                free = top + n_cached - popped
                room = (m - n_victims + n_new < S) & (budget > 0) & (w_need + w_revived <= free)
                held = w_again | _class_capped(w_pri, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT)
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
                                                        free_blocks_ptr, blocks, MAXB, BLOCK_J, Q, False)  # fmt: skip
                    budget += tl.sum(tl.where(is_v, n_k, 0), 0)
                    n_k = tl.where(is_v, 0, n_k)
                    nb_k = tl.where(is_v, 0, nb_k)
                    pre_k = tl.where(is_v, 1, pre_k)
                    n_victims += 1
                    victims_d = victims_d | (offs_d == v_slot)
                    eff_d = tl.where(offs_d == v_slot, pri_d.to(tl.int64), eff_d)  # back at its base priority
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
    sampler_index = _write_sample_rows(
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
def _capped_slots(st, md, n_capped, offs_d, slots, LIMIT: tl.constexpr, SLOT: tl.constexpr):
    """The slots the class cap preempted this step (cap_lower_classes stored them WAITING)."""
    capped = offs_d < 0
    if LIMIT > 0:
        if n_capped > 0:
            now = tl.load(slots.slot_state + offs_d, mask=md, other=SLOT.FREE)
            capped = md & (st == SLOT.RUNNING) & (now == SLOT.WAITING)
    return capped


@triton.jit
def _class_capped(w_pri, ms, pre_k, rp_k, adm_rank, adm_eff, LIMIT: tl.constexpr):
    """Scheduler._capped: with LIMIT > 0, a head of effective priority w_pri is held back when it is of
    a class below the most urgent running one (this step's admissions counted) while LIMIT running
    sequences already are."""
    capped = w_pri < w_pri
    if LIMIT > 0:
        kept = ms & (pre_k == 0)
        adm = adm_rank >= 0
        top_class = tl.minimum(
            tl.min(tl.where(kept, rp_k.to(tl.int64), _INT64_MAX), 0),
            tl.min(tl.where(adm, adm_eff, _INT64_MAX), 0),
        )
        n_lower = tl.sum((kept & (rp_k.to(tl.int64) > top_class)).to(tl.int32), 0) + tl.sum(
            (adm & (adm_eff > top_class)).to(tl.int32), 0
        )
        capped = (w_pri > top_class) & (n_lower >= LIMIT)
    return capped


@triton.jit
def _last_class(ms, pre_k, rp_k, offs_s):
    """The class (run_priority, int64) of the last running sequence in running order not preempted;
    below every priority when there is none (nothing to preempt)."""
    k = tl.max(tl.where(ms & (pre_k == 0), offs_s, -1), 0)
    return tl.where(k >= 0, tl.sum(tl.where(offs_s == k, rp_k, 0), 0).to(tl.int64), -_INT64_MAX)


@triton.jit
def _either_sampler(a, b):
    """The variant that serves the rows of both: the larger base variant, and the logprob and
    penalty parts of either (kernels/sampling.py: base + SAMPLER_LOGPROBS * (logprobs + 2 penalties))."""
    base = tl.maximum(a % _SAMPLER_LOGPROBS, b % _SAMPLER_LOGPROBS)
    return base + _SAMPLER_LOGPROBS * ((a // _SAMPLER_LOGPROBS) | (b // _SAMPLER_LOGPROBS))


@triton.jit
def _write_sample_rows(samples, row, slot, logits_row, slots, step):
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
    need = tl.where(random, tl.where(top_k > 0, _SAMPLER_FULL, _SAMPLER_REJECTION), _SAMPLER_GREEDY)
    logprobs = samples & (tl.load(slots.lp_top_n + slot, mask=samples, other=-1) >= 0)
    penalized = samples & (tl.load(slots.penalized + slot, mask=samples, other=0) != 0)
    return (
        tl.max(need, 0)
        + _SAMPLER_LOGPROBS * tl.max(logprobs.to(tl.int32), 0)
        + _SAMPLER_PENALTIES * tl.max(penalized.to(tl.int32), 0)
    )
