"""Schedule's outputs once the batch is known: the rest of the step tables and sample rows, the
SWITCH values (forward bucket, sampler), the forward's token rows and block tables, and the counters.

Part of the schedule program (kernels/schedule.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels import sampling

_INT32_MAX = tl.constexpr(2**31 - 1)
SAMPLER_SCORE = tl.constexpr(sampling.SAMPLER_SCORE)


@triton.jit
def finish_step_tables(
    nseq, ntot, nsamp, sampler_index, offs_s, step, buckets_ptr, step_num_tokens_ptr, bucket_index_ptr,
    sampler_index_ptr, num_sample_rows_ptr,
    S: tl.constexpr, NUM_BUCKETS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_S1: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):  # fmt: skip
    """The rest of the step tables (unused sequences and sample rows), the SWITCH values. Returns the
    bucket: the forward size that holds the step's `ntot` tokens."""
    unused_s = (offs_s >= nseq) & (offs_s < S)
    tl.store(step.step_slot + offs_s, tl.full([BLOCK_S], -1, tl.int32), mask=unused_s)
    tl.store(step.step_chunk + offs_s, tl.zeros([BLOCK_S], tl.int32), mask=unused_s)
    tl.store(step.context_lens + offs_s, tl.zeros([BLOCK_S], tl.int32), mask=unused_s)
    offs_s1 = tl.arange(0, BLOCK_S1)
    tl.store(
        step.query_start + offs_s1,
        tl.zeros([BLOCK_S1], tl.int32) + ntot,
        mask=(offs_s1 >= nseq) & (offs_s1 <= S),
    )
    unused_r = (offs_s >= nsamp) & (offs_s < S)
    tl.store(step.sample_slot + offs_s, tl.full([BLOCK_S], -1, tl.int32), mask=unused_r)
    tl.store(step.sample_rows + offs_s, tl.full([BLOCK_S], -1, tl.int64), mask=unused_r)
    tl.store(step.row_temperature + offs_s, tl.zeros([BLOCK_S], tl.float32), mask=unused_r)
    tl.store(step.row_top_k + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    tl.store(step.row_top_p + offs_s, tl.full([BLOCK_S], 1.0, tl.float32), mask=unused_r)
    tl.store(step.row_min_p + offs_s, tl.zeros([BLOCK_S], tl.float32), mask=unused_r)
    tl.store(step.row_seed + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    tl.store(step.row_output_index + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    offs_b = tl.arange(0, BLOCK_NB)
    buckets = tl.load(buckets_ptr + offs_b, mask=offs_b < NUM_BUCKETS, other=_INT32_MAX)
    bucket_index = tl.where(ntot > 0, tl.sum((buckets < ntot).to(tl.int32), 0), NUM_BUCKETS)
    bucket = tl.sum(tl.where(offs_b == bucket_index, buckets, 0), 0)
    tl.store(step_num_tokens_ptr, ntot)
    tl.store(bucket_index_ptr, bucket_index)
    tl.store(sampler_index_ptr, sampler_index)
    tl.store(num_sample_rows_ptr, nsamp)
    return bucket


@triton.jit
def write_forward_inputs(
    nseq, ntot, bucket, table_width, table_rows, offs_s, slots, step,
    S: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr, MAX_MODEL_LEN: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    """The forward's token rows (bucket padding included) and block tables of a step with tokens;
    the step tables are written and visible to every thread. Returns the block-table width the
    rows need now (the columns the next step has to clear at least)."""
    q_end = tl.load(step.query_start + 1 + offs_s, mask=offs_s < nseq, other=_INT32_MAX)
    # Every sequence of the batch has a chunk of one token or more, so with as many tokens as
    # sequences token t is sequence t's: no [tokens, max_seqs] search for the sequence of a row.
    decodes_only = ntot == nseq
    for t0 in range(0, bucket, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        in_step = t < ntot
        if decodes_only:
            b = t
        else:
            b = tl.sum((q_end[None, :] <= t[:, None]).to(tl.int32), 1)
        slot = tl.load(step.step_slot + b, mask=in_step, other=0)
        q0 = tl.load(step.query_start + b, mask=in_step, other=0)
        start = tl.load(step.context_lens + b, mask=in_step, other=0) - tl.load(
            step.step_chunk + b, mask=in_step, other=0
        )
        pos = start + t - q0
        tok = tl.load(slots.token_ids + slot * MAX_MODEL_LEN + pos, mask=in_step, other=0)
        block = tl.load(slots.block_table + slot * MAXB + pos // BS, mask=in_step, other=0)
        in_bucket = t < bucket
        tl.store(step.input_ids + t, tl.where(in_step, tok, 0).to(tl.int64), mask=in_bucket)
        tl.store(step.positions + t, tl.where(in_step, pos, 0).to(tl.int64), mask=in_bucket)
        mapping = tl.where(in_step, block.to(tl.int64) * BS + pos % BS, -1)
        tl.store(step.slot_mapping + t, mapping, mask=in_bucket)
    # Block tables: the batch's rows, -1 elsewhere. Only the rows and columns that can hold a block
    # id now or did after the last forward step are written (scratch keeps both; every row and
    # column beyond them is -1 already), so the cost follows the batch and its longest context, not
    # max_seqs and max_model_len.
    in_batch = offs_s < nseq
    slot_of = tl.load(step.step_slot + offs_s, mask=in_batch, other=0)
    width = tl.max(tl.load(slots.num_blocks + slot_of, mask=in_batch, other=0), 0)
    columns = tl.maximum(width, table_width)
    for r0 in range(0, tl.minimum(tl.maximum(nseq, table_rows), S), BLOCK_ROWS):
        r = r0 + tl.arange(0, BLOCK_ROWS)
        live = r < nseq
        rows = tl.load(step.step_slot + r, mask=live, other=0)
        for c0 in range(0, columns, BLOCK_C):
            col = c0 + tl.arange(0, BLOCK_C)
            cm = col[None, :] < columns
            table = tl.load(
                slots.block_table + rows[:, None] * MAXB + col[None, :], mask=live[:, None] & cm, other=-1
            )
            tl.store(step.block_tables + r[:, None] * MAXB + col[None, :], table, mask=(r < S)[:, None] & cm)
    return width


@triton.jit
def counter_deltas(
    ntot, n_preempted, n_admitted, n_rejected, n_cancelled, n_unaddressable, n_queried, n_hit, steady,
    BLOCK_NC: tl.constexpr, COUNTER: tl.constexpr,
):  # fmt: skip
    """What this iteration adds to each counter (lanes of `tl.arange(0, BLOCK_NC)`): one loop
    iteration, a step if it has tokens, and what it scheduled, preempted, admitted, rejected,
    cancelled and could not address, the prefix cache's looked-up and cached tokens, and whether it
    was a steady step (kernels/schedule_steady.py)."""
    offs_c = tl.arange(0, BLOCK_NC)
    steps = (ntot > 0).to(tl.int64)
    delta = (
        tl.where(offs_c == COUNTER.loop_iterations, 1, 0)
        + tl.where(offs_c == COUNTER.steps, steps, 0)
        + tl.where(offs_c == COUNTER.step_tokens, ntot.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.preemptions, n_preempted.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.requests_admitted, n_admitted.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.requests_rejected, n_rejected.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.requests_cancelled, n_cancelled.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.records_unaddressable, n_unaddressable.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.prefix_cache_queries, n_queried.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.prefix_cache_hits, n_hit.to(tl.int64), 0)
        + tl.where(offs_c == COUNTER.steady_steps, steady.to(tl.int64), 0)
    )
    return delta


@triton.jit
def write_score_rows(
    nseq, offs_s, slots, step, SCORE: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_SCORE: tl.constexpr,
):  # fmt: skip
    """The prompt positions p this step scores (model_runner._prompt_positions): those not scored yet
    whose predicting row p - 1 a chunk feeds, of one sequence at most (Scheduler phase 6). Writes
    their token rows for the forward's gather, the score rows and the slot's next position; the step
    tables are written and visible to every thread. Returns how many."""
    in_b = offs_s < nseq
    slot = tl.load(step.step_slot + offs_s, mask=in_b, other=0)
    end = tl.load(step.context_lens + offs_s, mask=in_b, other=0)
    start = end - tl.load(step.step_chunk + offs_s, mask=in_b, other=0)
    plen = tl.load(slots.prompt_len + slot, mask=in_b, other=0)
    lo = tl.maximum(tl.load(slots.lp_next + slot, mask=in_b, other=0), start + 1)
    hi = tl.minimum(plen, end + 1)
    scores = in_b & (hi > lo)
    n = tl.sum(tl.where(scores, hi - lo, 0), 0)
    s_slot = tl.sum(tl.where(scores, slot, 0), 0)
    s_lo = tl.sum(tl.where(scores, lo, 0), 0)
    s_plen = tl.sum(tl.where(scores, plen, 0), 0)
    s_row = tl.sum(
        tl.where(scores, tl.load(step.query_start + offs_s, mask=in_b, other=0) + lo - 1 - start, 0), 0
    )
    temperature = tl.load(slots.temperature + s_slot)
    tl.store(slots.lp_next + slot, hi, mask=scores)
    j = tl.arange(0, BLOCK_SCORE)
    used = j < n
    inside = j < SCORE
    token = tl.load(slots.token_ids + s_slot * MAX_MODEL_LEN + s_lo + j, mask=used, other=0)
    tl.store(step.score_rows + j, tl.where(used, s_row + j, -1).to(tl.int64), mask=inside)
    tl.store(step.score_slot + j, tl.where(used, s_slot, -1), mask=inside)
    tl.store(step.score_token + j, token.to(tl.int64), mask=inside)
    tl.store(step.score_index + j, (s_lo + j - s_plen).to(tl.int64), mask=inside)
    tl.store(step.score_temperature + j, tl.zeros([BLOCK_SCORE], tl.float32) + temperature, mask=inside)
    tl.store(step.num_score_rows, n)
    return n
