"""Schedule's steady decode step: the last step's batch again, one token each, without the full batch.

Part of the schedule program (kernels/schedule.py). Most steps of a serving loop repeat the step
before: nothing arrived, nothing was cancelled or finished, and every sequence of the batch decodes.
Then the full path (order the running slots, fill the budget, admit, write every table, rebuild the
forward's rows from the step tables) would reach the same batch in the same order, since run order
is fixed while a slot runs. This path takes the order from the last step's `step_slot` instead, pops
the blocks the new tokens need exactly as the budget fill would, and rewrites only what a decode
changes: num_computed, num_blocks, the context lengths, the output index of each sample row, and the
forward's token rows and new block-table entries. What stays is the last step's: step tables, query
starts, sample rows, their sampling parameters, the bucket and the sampler variant (a running slot's
parameters never change), bucket padding and the prompt-scoring rows (a decode scores nothing, and
the last step, decodes only too, cleared them).

`steady_decodes` says whether the step qualifies; anything else takes the full path. A differential
test runs both paths on the same state every step (tests/test_device_scheduler_steady.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import take_blocks
from blink_appliance.kernels.schedule_batch import blocks_to_add, store_running


@triton.jit
def steady_decodes(
    no_ring_work, st, md, top, n_cached, table_width, table_rows, step_num_tokens_ptr, offs_s, slots, step,
    BS: tl.constexpr, PBS: tl.constexpr, STEADY: tl.constexpr, SLOT: tl.constexpr,
):  # fmt: skip
    """Whether this step is the last one's batch decoding again: the ring brings no work (no shutdown,
    cancel or record to take), the last step ran decodes only, the live slots are exactly its batch,
    all RUNNING, each with one uncomputed token past its prompt (so no prompt block to register), and
    the free stack and the LRU hold the blocks the new tokens need (no preemption). A program built
    without STEADY (the differential test's other side) always says no.

    The class cap and best-effort turns need no check: they hold running slots by the running set's
    classes (and, for the turns, only when more best-effort slots run than a turn takes). The last
    step held none, since every live slot was in its batch, and the running set has not changed.
    Returns (steady, the batch's lanes, its slots in run order, num_tokens, num_computed, num_blocks,
    prompt_len, the blocks each needs)."""
    ntot_prev = tl.load(step_num_tokens_ptr)
    ms = offs_s < table_rows  # table_rows: the last forward step's sequences
    ks = tl.load(step.step_slot + offs_s, mask=ms, other=-1)
    # -1 after a step without a forward (or before the first): such a lane is no slot to load from.
    mk = ms & (ks >= 0)
    st_k = tl.load(slots.slot_state + ks, mask=mk, other=SLOT.FREE)
    ntok_k = tl.load(slots.num_tokens + ks, mask=mk, other=1)
    ncomp_k = tl.load(slots.num_computed + ks, mask=mk, other=0)
    nb_k = tl.load(slots.num_blocks + ks, mask=mk, other=0)
    plen_k = tl.load(slots.prompt_len + ks, mask=mk, other=0)
    past_prompt = ncomp_k >= plen_k
    if PBS > 0:  # the blocks a chunk fills register only below the slot's number of prompt hashes
        past_prompt = past_prompt & (ncomp_k >= tl.load(slots.n_hashes + ks, mask=mk, other=0) * BS)
    lane_ok = (st_k == SLOT.RUNNING) & (ntok_k - ncomp_k == 1) & past_prompt
    need_k = tl.where(ms, blocks_to_add(ncomp_k, 1, nb_k, BS), 0)
    n_live = tl.sum((md & (st != SLOT.FREE)).to(tl.int32), 0)
    steady = (
        no_ring_work
        & (ntot_prev > 0)
        & (ntot_prev == table_rows)
        & (n_live == table_rows)
        & (tl.sum((ms & ~lane_ok).to(tl.int32), 0) == 0)
        & (tl.sum(need_k, 0) <= top + n_cached)
        & (table_width <= tl.max(nb_k + need_k, 0))
    )
    if not STEADY:
        steady = n_live < 0
    return steady, ms, ks, ntok_k, ncomp_k, nb_k, plen_k, need_k


@triton.jit
def decode_again(
    ms, ks, ntok_k, ncomp_k, nb_k, plen_k, need_k, top, head, tail, n_cached, clock, offs_s, free_blocks_ptr,
    slots, blocks, step,
    BS: tl.constexpr, MAXB: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, BLOCK_J: tl.constexpr,
    C: tl.constexpr, Q: tl.constexpr, BLOCK_L: tl.constexpr, SLOT: tl.constexpr,
):  # fmt: skip
    """The steady step (steady_decodes said so): each sequence of the batch computes its last token.
    Blocks are popped in run order as the budget fill pops them; then the slots, the context lengths,
    the sample rows' output index and the forward's token rows (row b is sequence b's) are written.
    Returns (top, LRU head, live count, the block-table width the rows need now)."""
    if tl.sum(need_k, 0) > 0:  # take_blocks ends with a barrier: the new table entries are read below
        top, head, n_cached = take_blocks(ms, need_k, tl.cumsum(need_k, 0) - need_k, ks, nb_k, top, head, tail,
                                          n_cached, slots.block_table, free_blocks_ptr, blocks, MAXB, BLOCK_J,
                                          C, Q, BLOCK_L)  # fmt: skip
    nb_k = nb_k + need_k
    store_running(ms, ks, ncomp_k, tl.where(ms, 1, 0), nb_k, tl.zeros_like(ks), clock, slots, SLOT)
    tl.store(step.context_lens + offs_s, ncomp_k + 1, mask=ms)
    tl.store(step.row_output_index + offs_s, (ntok_k - plen_k).to(tl.int64), mask=ms)
    column = ncomp_k // BS
    block = tl.load(slots.block_table + ks * MAXB + column, mask=ms, other=0)
    token = tl.load(slots.token_ids + ks * MAX_MODEL_LEN + ncomp_k, mask=ms, other=0)
    tl.store(step.input_ids + offs_s, token.to(tl.int64), mask=ms)
    tl.store(step.positions + offs_s, ncomp_k.to(tl.int64), mask=ms)
    tl.store(step.slot_mapping + offs_s, block.to(tl.int64) * BS + ncomp_k % BS, mask=ms)
    tl.store(step.block_tables + offs_s * MAXB + column, block, mask=ms)
    return top, head, n_cached, tl.max(tl.where(ms, nb_k, 0), 0)
