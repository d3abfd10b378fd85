"""Schedule's batch: which sequences run this step and how many tokens each, as the reference
Scheduler.schedule picks them (with a class cap, the running ones of a lower class than the most
urgent running one beyond the cap held; the others in (class, admission) order: decodes first, prefill
chunks in the rest of the token budget, KV blocks from the free stack, recompute preemption of the
last in that order; then admission of waiting slots in (effective priority, arrival) order, which
preempts running slots of a strictly lower class when the head does not fit), written into the step
tables and the sample rows.

Part of the schedule program (kernels/schedule.py): running sequences are put in run order once
(compaction + a rank over the running ones, through a small scratch buffer) and the budget fill is done in
vectorized rounds (prefix sums), one round per preemption event, so a step without preemption is
one round. Admission (kernels/schedule_admit.py) is the sequential part. KV blocks come and go
through kernels/prefix_cache.py: holders, the free stack, the LRU of cached blocks, and at the end
the registration of the prompt blocks this step's chunks fill.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import register_filled, release_lanes, take_blocks
from blink_appliance.kernels.ring_access import phase_stamp
from blink_appliance.kernels.schedule_admit import admit_waiting, either_sampler, write_sample_rows
from blink_appliance.kernels.schedule_step import SAMPLER_SCORE, write_score_rows

_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def build_batch(
    st, md, top, head, tail, n_cached, next_run_order, clock, offs_s, scratch_ptr, free_blocks_ptr, slots,
    blocks, step,
    S: tl.constexpr, MAX_BATCHED: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_RANK: tl.constexpr,
    AGING: tl.constexpr, LIMIT: tl.constexpr, SCORE: tl.constexpr, PBS: tl.constexpr, C: tl.constexpr,
    Q: tl.constexpr, HSTRIDE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HASH: tl.constexpr,
    BLOCK_SCORE: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, SLOT: tl.constexpr, BE_BATCH: tl.constexpr,
    BE_PRI: tl.constexpr, stamps_ptr, STAMPS: tl.constexpr,
):  # fmt: skip
    """The step's batch (Scheduler.schedule): the class cap's and the best-effort turns' hold, running slots in running order get
    their chunks, then waiting slots are admitted; slot state, step tables and sample rows written. Returns
    (stack top, LRU head, tail and live count, next_run_order, sequences, tokens, sample rows, sampler
    variant, preemptions, prefix cache tokens looked up and found)."""
    m, ms, ks, ntok_k, ncomp_k, nb_k, rp_k = order_running(
        st, md, offs_s, scratch_ptr, slots, BLOCK_D, BLOCK_RANK, SLOT
    )
    phase_stamp(stamps_ptr, 4, STAMPS)
    hold_k = hold_lower_classes(m, ms, rp_k, offs_s, LIMIT) | wait_turn(ms, rp_k, clock, BE_BATCH, BE_PRI)
    want_k, scoring = prompt_scorer(m, ks, ntok_k, ncomp_k, hold_k, offs_s, slots, SCORE, BLOCK_S)
    phase_stamp(stamps_ptr, 5, STAMPS)
    n_k, nb_k, pre_k, budget, top, head, tail, n_cached, n_preempted = fill_budget(
        top, head, tail, n_cached, m, ks, ntok_k, ncomp_k, want_k, hold_k, nb_k, offs_s, free_blocks_ptr, slots,
        blocks, MAX_BATCHED, BS, MAXB, BLOCK_S, BLOCK_J, C, Q, BLOCK_L,
    )  # fmt: skip
    phase_stamp(stamps_ptr, 6, STAMPS)
    n_k, nb_k, pre_k, top, head, tail, n_cached, next_run_order, n_victims, new, n_queried, n_hit = admit_waiting(
        budget, top, head, tail, n_cached, next_run_order, st, md, m, n_preempted, clock, scoring,
        ms, ks, ntok_k, ncomp_k, n_k, nb_k, pre_k, rp_k, free_blocks_ptr, slots, blocks, step,
        S, BS, MAXB, BLOCK_D, BLOCK_S, BLOCK_J, AGING, LIMIT, SCORE, PBS, C, Q, HSTRIDE, BLOCK_L, BLOCK_HASH, SLOT,
    )  # fmt: skip
    phase_stamp(stamps_ptr, 7, STAMPS)
    n_new, ntot_new, nsamp_new, sampler_new = new
    store_running(ms, ks, ncomp_k, n_k, nb_k, pre_k, clock, slots, SLOT)
    nseq, ntot, nsamp, sampler_index = write_running_batch(ks, ntok_k, ncomp_k, n_k, slots, step)
    sampler_index = either_sampler(sampler_index, sampler_new)
    phase_stamp(stamps_ptr, 8, STAMPS)
    tl.debug_barrier()  # the step tables above are every thread's to read
    # The prompt positions the step scores: one sequence's at most (Scheduler phase 6).
    if write_score_rows(nseq + n_new, offs_s, slots, step, SCORE, MAX_MODEL_LEN, BLOCK_S, BLOCK_SCORE) > 0:
        sampler_index += SAMPLER_SCORE
    if PBS > 0:  # the step's chunks register the prompt blocks they fill (Scheduler._register_filled)
        register_filled(nseq + n_new, step.step_slot, step.step_chunk, step.context_lens, slots.n_hashes,
                        slots.prefix_hash, slots.block_table, blocks, BS, MAXB, C, HSTRIDE, BLOCK_S,
                        BLOCK_HASH)  # fmt: skip
    phase_stamp(stamps_ptr, 9, STAMPS)
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
        n_preempted + n_victims,
        n_queried,
        n_hit,
    )


@triton.jit
def _run_keys(compact_ptrs, mask, slots):
    """The running slots listed at compact_ptrs, with their run order and run priority."""
    slot = tl.load(compact_ptrs, mask=mask, other=0)
    return (
        slot,
        tl.load(slots.run_order + slot, mask=mask, other=0),
        tl.load(slots.run_priority + slot, mask=mask, other=0),
    )


@triton.jit
def _ranked_before(rp, ro, rp_j, ro_j, mj):
    """For each (run_priority, run_order) pair of rp/ro, how many of the j lanes (mj) run before it."""
    before = (rp_j[None, :] < rp[:, None]) | ((rp_j[None, :] == rp[:, None]) & (ro_j[None, :] < ro[:, None]))
    return tl.sum((mj[None, :] & before).to(tl.int32), 1)


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
    if m <= RANK_TILE:  # one [RANK_TILE, RANK_TILE] tile, whatever max_seqs (batch 1 lands here)
        offs_i = tl.arange(0, RANK_TILE)
        mi = offs_i < m
        slot_i, ro_i, rp_i = _run_keys(scratch_ptr + offs_i, mi, slots)
        rank_i = _ranked_before(rp_i, ro_i, rp_i, ro_i, mi)
        tl.store(scratch_ptr + BLOCK_D + rank_i, slot_i, mask=mi)
    else:
        compact, ro, rp = _run_keys(scratch_ptr + offs_s, ms, slots)
        # The rank counts over the m running sequences only, a tile at a time: an S x S comparison
        # would cost max_seqs^2 every step whatever the batch.
        rank = tl.zeros_like(offs_s)
        for j0 in range(0, m, RANK_TILE):
            offs_j = j0 + tl.arange(0, RANK_TILE)
            mj = offs_j < m
            _, ro_j, rp_j = _run_keys(scratch_ptr + offs_j, mj, slots)
            rank += _ranked_before(rp, ro, rp_j, ro_j, mj)
        tl.store(scratch_ptr + BLOCK_D + rank, compact, mask=ms)
    tl.debug_barrier()
    ks = tl.load(scratch_ptr + BLOCK_D + offs_s, mask=ms, other=0)  # slot of the k-th running sequence
    ntok_k = tl.load(slots.num_tokens + ks, mask=ms, other=0)
    ncomp_k = tl.load(slots.num_computed + ks, mask=ms, other=0)
    nb_k = tl.load(slots.num_blocks + ks, mask=ms, other=0)
    rp_k = tl.load(slots.run_priority + ks, mask=ms, other=0)
    return m, ms, ks, ntok_k, ncomp_k, nb_k, rp_k


@triton.jit
def prompt_scorer(m, ks, ntok_k, ncomp_k, hold_k, offs_s, slots, SCORE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Scheduler phase 6 over the first m running sequences: the first one not held prefilling with
    prompt positions left to score wants at most SCORE tokens, the other such ones none this step.
    Returns (the tokens each wants, whether one of them scores)."""
    rem_k = ntok_k - ncomp_k
    live = offs_s < m
    scores_k = live & (
        tl.load(slots.lp_next + ks, mask=live, other=0) < tl.load(slots.prompt_len + ks, mask=live, other=0)
    )
    prefilling = scores_k & (rem_k != 1) & ~hold_k
    first = tl.min(tl.where(prefilling, offs_s, BLOCK_S), 0)
    want_k = tl.where(prefilling, tl.where(offs_s == first, tl.minimum(rem_k, SCORE), 0), rem_k)
    return want_k, first < BLOCK_S


@triton.jit
def hold_lower_classes(m, ms, rp_k, offs_s, LIMIT: tl.constexpr):
    """Phase 0 (Scheduler._held): with LIMIT >= 0, the running sequences of a class below the most
    urgent running one beyond the first LIMIT of them (the tail of the run order) are held: no tokens
    this step, blocks kept. Returns the held lanes."""
    hold_k = offs_s < 0
    if LIMIT >= 0:
        top_class = tl.min(tl.where(ms, rp_k, _INT32_MAX), 0)
        n_lower = tl.sum((ms & (rp_k > top_class)).to(tl.int32), 0)
        hold_k = ms & (offs_s >= m - tl.maximum(n_lower - LIMIT, 0))
    return hold_k


@triton.jit
def wait_turn(ms, rp_k, clock, BE_BATCH: tl.constexpr, BE_PRI: tl.constexpr):
    """Phase 0's best-effort turns (Scheduler._waiting_turn): with BE_BATCH >= 1, of the n running
    sequences of a class >= BE_PRI, rank r (in run order) is held unless (r - clock * BE_BATCH) mod n
    < BE_BATCH. Returns the held lanes."""
    hold_k = ms & (rp_k < rp_k)
    if BE_BATCH >= 1:
        best_effort = ms & (rp_k >= BE_PRI)
        be_i = best_effort.to(tl.int64)
        n = tl.sum(be_i, 0)
        if n > BE_BATCH:
            start = clock.to(tl.int64) * BE_BATCH % n
            turn = (tl.cumsum(be_i, 0) - be_i - start + n) % n
            hold_k = best_effort & (turn >= BE_BATCH)
    return hold_k


@triton.jit
def fill_budget(
    top, head, tail, n_cached, m, ks, ntok_k, ncomp_k, want_k, hold_k, nb_k, offs_s, free_blocks_ptr, slots, blocks,
    MAX_BATCHED: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_J: tl.constexpr, C: tl.constexpr, Q: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """The budget fill (Scheduler.schedule phases 1-2) of the m running sequences in run order, in
    rounds (store_running stores the outcome once admission is done). want_k: the tokens each
    prefilling one wants (its uncomputed ones, or fewer: prompt_scorer); hold_k: lanes the class cap
    holds (no tokens, but victims like any other).
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
    pre_k = tl.zeros([BLOCK_S], tl.int32)
    zeros = tl.zeros([BLOCK_S], tl.int32)
    budget = tl.full([], MAX_BATCHED, tl.int32)
    i0 = tl.full([], 0, tl.int32)
    hi = m - 1
    while i0 <= hi:
        act = (offs_s >= i0) & (offs_s <= hi)
        dec = act & (rem_k == 1) & ~hold_k
        pref = act & (rem_k != 1) & ~hold_k
        prefill_budget = budget - tl.sum(dec.to(tl.int32), 0)
        prem = tl.where(pref, want_k, 0)
        wanted_before = tl.cumsum(prem, 0) - prem  # by the round's earlier prefills
        n = tl.where(
            dec, 1, tl.where(pref, tl.minimum(tl.maximum(prefill_budget - wanted_before, 0), want_k), 0)
        )
        # (a chunk taken back by admission leaves its blocks: a sequence may hold more than it needs)
        need = tl.where(n > 0, blocks_to_add(ncomp_k, n, nb_k, BS), 0)
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
                                                    free_blocks_ptr, blocks, MAXB, BLOCK_J, Q)  # fmt: skip
                pre_k = tl.where(is_v, 1, pre_k)
                nb_k = tl.where(is_v, 0, nb_k)
                v -= 1
            survives = top + n_cached >= need_k
            if top + n_cached < need_k:  # it is the victim itself
                top, tail, n_cached = release_lanes(is_k, offs_s, ks, nb_k, top, tail, n_cached, block_table_ptr,
                                                    free_blocks_ptr, blocks, MAXB, BLOCK_J, Q)  # fmt: skip
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
def blocks_to_add(num_computed, n, num_blocks, BS: tl.constexpr):
    """The blocks a chunk of n tokens after num_computed needs beyond the num_blocks held (0 when it
    holds enough: a chunk taken back by admission leaves its blocks)."""
    return tl.maximum((num_computed + n + BS - 1) // BS - num_blocks, 0)


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
    sampler_index = write_sample_rows(samples_k, row_k, ks, (qs_k + n_k - 1).to(tl.int64), slots, step)
    return nseq, ntot, nsamp, sampler_index
