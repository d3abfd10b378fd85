"""The GPU loop's commit step (one Triton program): append sampled tokens, publish them to the ring,
apply the stop rules, publish terminal events, release finished slots and their KV blocks.

State semantics are engine/loop/state.py's; the wrapper is engine/loop/commit.py; the
publication protocol is docs/protocol.md ("Publication order", GPU paragraph). Slot states, finish
codes, counter indices and the channel structs' offsets arrive as constexprs (kernels/loop_codes.py).

1. Sample rows r with sample_slot[r] = s >= 0 and slot s RUNNING: token t = sampled[r], output
   index i = num_tokens[s] - prompt_len[s]; token_ids[s, num_tokens[s]] = t; num_tokens[s] += 1;
   ring tokens[chan, i] = t, times[chan, i] = now. Stop rules in the reference engine's order (EOS
   unless ignore_eos, stop ids -> STOP; max_tokens, max_model_len -> LENGTH). Publication: payload
   (tokens, times; the status record of a finishing row), a system-scope fence by every thread, a
   barrier, then `count` (i + 1, | FINAL_BIT
   when finishing) with a system-scope release store; when a row finishes, a fence, a barrier,
   then `done` = generation the same way for it. A row whose output index is past the channel's capacity publishes
   no token and finishes LENGTH (the ring server's rule; admission keeps max_tokens within it).
2. Slots in FINISHING (schedule's cancels, rejected records, shutdown): status (their finish_reason
   / error_code, terminal_token 0), count = the channel's count | FINAL_BIT, done = generation.
3. Every released slot (finished rows first, in row order, then FINISHING slots in slot order)
   lets go of its blocks, its table in reverse (engine/reference/block_allocator.py's order): a block
   left with no holder goes on the free stack, or to the LRU's tail when it is cached
   (kernels/prefix_cache.py). The slot clears its table to -1 and becomes FREE.
4. Counters: generated_tokens, requests_finished (every terminal except finish_reason ERROR, i.e.
   rejected records); num_active -= released; keep_running = (shutdown_seen == 0). When the
   iteration ran a forward (step_num_tokens > 0): last_step_ns = now - step_start_ns (schedule's
   stamp) and one more step in its step_time_hist bucket (ring_layout.STEP_TIME_BOUNDS_US).

Barriers order the program's own threads. On the H100 (2026-11-23, 64 sequences) the front end read
a channel's count before that step's token and stamp and delivered zeros; the likely cause is that a
release store by one warp after a CTA barrier does not keep another warp's earlier stores to host
memory from arriving after it. So every thread fences its own ring stores at system scope
(`fence.acq_rel.sys`, kernels/ring_access.py) before the barrier that precedes a publication
(bench/results/2026-11-25-h100-commit-fence.md: 0 late tokens with it, 315 without). The clock is
%globaltimer plus clock_offset_ns on the GPU; under the interpreter (no inline asm) it is
host_clock_ns[0], the host monotonic clock the wrapper stores just before the launch.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import BlockTensors, release_lanes
from blink_appliance.kernels.ring_access import fence_sys, now_ns, store_release


@triton.jit
def commit_kernel(
    sample_slot_ptr, sampled_ptr,
    slot_state_ptr, chan_ptr, generation_ptr, prompt_len_ptr, num_tokens_ptr, max_tokens_ptr,
    ignore_eos_ptr, n_stop_ptr, stop_ids_ptr, token_ids_ptr, block_table_ptr, num_blocks_ptr,
    finish_reason_ptr, error_code_ptr,
    free_blocks_ptr, free_top_ptr, block_ref_ptr, block_cached_ptr, block_key_ptr, cache_table_ptr, lru_ptr,
    lru_pos_ptr, lru_words_ptr, evicted_ptr, num_active_ptr, shutdown_seen_ptr, keep_running_ptr,
    clock_offset_ns_ptr, host_clock_ns_ptr, counters_ptr, eos_ptr,
    ring64_ptr, ring32_ptr, tokens_at, times_at, prog_at, stat_at,
    step_start_ns_ptr, step_num_tokens_ptr, step_time_hist_ptr, step_bounds_ptr,
    S, D, max_output_tokens, max_inflight,
    MAX_STOP: tl.constexpr, BLOCK_STOP: tl.constexpr, MAX_EOS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    NUM_STEP_BUCKETS: tl.constexpr, BLOCK_H: tl.constexpr, Q: tl.constexpr,
    # codes and offsets (kernels/loop_codes.py): SlotStates, FinishCodes, CommitCounters, ChannelLayout
    SLOT: tl.constexpr, FINISH: tl.constexpr, COUNTER: tl.constexpr, CHANNEL: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    now = now_ns(host_clock_ns_ptr, clock_offset_ns_ptr, ON_GPU)
    blocks = BlockTensors(block_ref_ptr, block_cached_ptr, block_key_ptr, cache_table_ptr, lru_ptr, lru_pos_ptr,
                          evicted_ptr)  # fmt: skip
    final_bit = tl.full([], 1, tl.int64) << 63
    # One-element words this program updates: read here, written once at the end after a barrier
    # (kernels/schedule.py's docstring says why: a store by one thread may beat another warp's load).
    top = tl.load(free_top_ptr)
    generated_before = tl.load(counters_ptr + COUNTER.generated_tokens)
    finished_before = tl.load(counters_ptr + COUNTER.requests_finished)
    active_before = tl.load(num_active_ptr)
    h = tl.arange(0, BLOCK_H)
    hist = tl.load(step_time_hist_ptr + h, mask=h < NUM_STEP_BUCKETS, other=0)
    last_step = tl.load(counters_ptr + COUNTER.last_step_ns)
    ran = tl.load(step_num_tokens_ptr) > 0
    step_ns = now - tl.load(step_start_ns_ptr)
    bounds = tl.load(step_bounds_ptr + h, mask=h < NUM_STEP_BUCKETS - 1, other=0)
    bucket = tl.sum(((h < NUM_STEP_BUCKETS - 1) & (step_ns > bounds)).to(tl.int32), 0)

    # -- 1. sampled rows -----------------------------------------------------------------------------
    top, generated, n_finished = _commit_rows(
        now, final_bit, top, sample_slot_ptr, sampled_ptr, slot_state_ptr, chan_ptr, generation_ptr,
        prompt_len_ptr, num_tokens_ptr, max_tokens_ptr, ignore_eos_ptr, n_stop_ptr, stop_ids_ptr,
        token_ids_ptr, block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr, eos_ptr,
        ring64_ptr, ring32_ptr, tokens_at, times_at, prog_at, stat_at, S, max_output_tokens, max_inflight,
        MAX_STOP, BLOCK_STOP, MAX_EOS, MAX_BLOCKS, MAX_MODEL_LEN, BLOCK_S, BLOCK_B, Q,
        SLOT, FINISH, CHANNEL, ON_GPU,
    )  # fmt: skip
    tl.debug_barrier()

    # -- 2. FINISHING slots: terminal without a token ---------------------------------------------------
    top, n_closed, counted = _close_slots(
        now, final_bit, top, slot_state_ptr, chan_ptr, generation_ptr, finish_reason_ptr, error_code_ptr,
        block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr, ring64_ptr, ring32_ptr, prog_at,
        stat_at, D, max_inflight, MAX_BLOCKS, BLOCK_D, BLOCK_B, Q, SLOT, FINISH, CHANNEL, ON_GPU,
    )  # fmt: skip

    # -- 3. counters and loop control ---------------------------------------------------------------------
    counted = counted + n_finished
    keep_running = (tl.load(shutdown_seen_ptr) == 0).to(tl.int32)
    tl.debug_barrier()  # every warp has read the words below before one thread writes them
    tl.store(free_top_ptr, top)
    tl.store(counters_ptr + COUNTER.generated_tokens, generated_before + generated)
    tl.store(counters_ptr + COUNTER.requests_finished, finished_before + counted)
    tl.store(num_active_ptr, active_before - n_finished - n_closed)
    tl.store(keep_running_ptr, keep_running)
    tl.store(step_time_hist_ptr + h, hist + ((h == bucket) & ran).to(tl.int64), mask=h < NUM_STEP_BUCKETS)
    tl.store(counters_ptr + COUNTER.last_step_ns, tl.where(ran, step_ns, last_step))


@triton.jit
def _commit_rows(
    now, final_bit, top, sample_slot_ptr, sampled_ptr, slot_state_ptr, chan_ptr, generation_ptr,
    prompt_len_ptr, num_tokens_ptr, max_tokens_ptr, ignore_eos_ptr, n_stop_ptr, stop_ids_ptr,
    token_ids_ptr, block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr, eos_ptr,
    ring64_ptr, ring32_ptr, tokens_at, times_at, prog_at, stat_at, S, max_output_tokens, max_inflight,
    MAX_STOP: tl.constexpr, BLOCK_STOP: tl.constexpr, MAX_EOS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, Q: tl.constexpr,
    SLOT: tl.constexpr, FINISH: tl.constexpr, CHANNEL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Step 1 of the module docstring: append and publish each sample row's token, apply the stop
    rules, publish and release the rows that finish. Returns (stack top, tokens generated, rows
    finished)."""
    r = tl.arange(0, BLOCK_S)
    s = tl.load(sample_slot_ptr + r, mask=r < S, other=-1)
    row = (r < S) & (s >= 0)
    s = tl.where(row, s, 0)
    row = row & (tl.load(slot_state_ptr + s, mask=row, other=SLOT.FREE) == SLOT.RUNNING)
    token = tl.load(sampled_ptr + r, mask=row, other=0).to(tl.int32)
    n = tl.load(num_tokens_ptr + s, mask=row, other=0)
    i = n - tl.load(prompt_len_ptr + s, mask=row, other=0)  # output index of this token
    chan = tl.load(chan_ptr + s, mask=row, other=0)
    row = row & (chan >= 0) & (chan < max_inflight)
    chan = chan.to(tl.int64)
    room = row & (i < max_output_tokens)
    # Every warp has loaded num_tokens before some warp's lanes store n + 1: up to 32 rows the lines
    # above hold no barrier, and a warp loading late would see the new count.
    tl.debug_barrier()
    tl.store(token_ids_ptr + s.to(tl.int64) * MAX_MODEL_LEN + n, token, mask=room & (n < MAX_MODEL_LEN))
    tl.store(num_tokens_ptr + s, n + 1, mask=room)

    eos = tl.load(eos_ptr + tl.arange(0, MAX_EOS))  # -1 padded
    is_eos = tl.max((token[:, None] == eos[None, :]).to(tl.int32), 1) != 0
    n_stop = tl.load(n_stop_ptr + s, mask=row, other=0)
    k = tl.arange(0, BLOCK_STOP)
    listed = row[:, None] & (k[None, :] < n_stop[:, None]) & (k[None, :] < MAX_STOP)
    stop_ids = tl.load(stop_ids_ptr + s[:, None] * MAX_STOP + k[None, :], mask=listed, other=-1)
    is_stop = tl.max((token[:, None] == stop_ids).to(tl.int32), 1) != 0
    ignore_eos = tl.load(ignore_eos_ptr + s, mask=row, other=0) != 0
    stop = (is_eos & ~ignore_eos) | is_stop
    length = (i + 1 >= tl.load(max_tokens_ptr + s, mask=row, other=0)) | (n + 1 >= MAX_MODEL_LEN)
    reason = tl.where(stop, FINISH.STOP, tl.where(length, FINISH.LENGTH, 0))
    reason = tl.where(room, reason, FINISH.LENGTH)  # out of channel capacity: finish without the token
    finished = row & (reason != 0)

    at = chan * max_output_tokens + i
    tl.store(ring32_ptr + tokens_at + at, token, mask=room)
    tl.store(ring64_ptr + times_at + at, tl.zeros_like(at) + now, mask=room)
    stat64 = stat_at // 8 + chan * (CHANNEL.status_bytes // 8)
    stat32 = stat_at // 4 + chan * (CHANNEL.status_bytes // 4)
    tl.store(ring64_ptr + stat64 + CHANNEL.status_finish_ns // 8, tl.zeros_like(at) + now, mask=finished)
    tl.store(ring32_ptr + stat32 + CHANNEL.status_finish_reason // 4, reason, mask=finished)
    tl.store(ring32_ptr + stat32 + CHANNEL.status_error_code // 4, tl.zeros_like(reason), mask=finished)
    tl.store(ring32_ptr + stat32 + CHANNEL.status_terminal_token // 4, room.to(tl.int32), mask=finished)
    fence_sys(ON_GPU)
    tl.debug_barrier()
    prog = prog_at // 8 + chan * (CHANNEL.progress_bytes // 8)
    count = tl.where(room, i + 1, i).to(tl.int64)
    count = tl.where(finished, count | final_bit, count)
    store_release(ring64_ptr + prog + CHANNEL.progress_count // 8, count, ON_GPU, mask=row)
    n_finished = tl.sum(finished.to(tl.int32), 0)
    # Most steps finish no row: the second fence (a bus round trip) and the release are skipped then.
    if n_finished > 0:
        fence_sys(ON_GPU)
        tl.debug_barrier()
        generation = tl.load(generation_ptr + s, mask=finished, other=0)
        store_release(ring64_ptr + prog + CHANNEL.progress_done // 8, generation, ON_GPU, mask=finished)
        top = _release_blocks(
            s, finished, top, block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr,
            MAX_BLOCKS, BLOCK_B, Q,
        )  # fmt: skip
        tl.store(slot_state_ptr + s, tl.full([BLOCK_S], SLOT.FREE, tl.int32), mask=finished)
    generated = tl.sum(room.to(tl.int64), 0)
    return top, generated, n_finished


@triton.jit
def _close_slots(
    now, final_bit, top, slot_state_ptr, chan_ptr, generation_ptr, finish_reason_ptr, error_code_ptr,
    block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr, ring64_ptr, ring32_ptr, prog_at,
    stat_at, D, max_inflight, MAX_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    Q: tl.constexpr, SLOT: tl.constexpr, FINISH: tl.constexpr, CHANNEL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Step 2 of the module docstring: publish the terminal event of every FINISHING slot (no
    token) and release it. Returns (stack top, slots closed, how many of them count as finished
    requests: all but rejected records)."""
    d = tl.arange(0, BLOCK_D)
    closing = (d < D) & (tl.load(slot_state_ptr + d, mask=d < D, other=SLOT.FREE) == SLOT.FINISHING)
    n_closed = tl.sum(closing.to(tl.int32), 0)
    counted = tl.zeros([], tl.int64)
    # Most steps close nothing: the fences, the scan and the stores below are then skipped, so the
    # step does not pay for every slot of the geometry.
    if n_closed > 0:
        c = tl.load(chan_ptr + d, mask=closing, other=-1)
        publish = closing & (c >= 0) & (c < max_inflight)
        c = tl.where(publish, c, 0).to(tl.int64)
        why = tl.load(finish_reason_ptr + d, mask=closing, other=0)
        err = tl.load(error_code_ptr + d, mask=closing, other=0)
        stat64 = stat_at // 8 + c * (CHANNEL.status_bytes // 8)
        stat32 = stat_at // 4 + c * (CHANNEL.status_bytes // 4)
        tl.store(ring64_ptr + stat64 + CHANNEL.status_finish_ns // 8, tl.zeros_like(c) + now, mask=publish)
        tl.store(ring32_ptr + stat32 + CHANNEL.status_finish_reason // 4, why, mask=publish)
        tl.store(ring32_ptr + stat32 + CHANNEL.status_error_code // 4, err, mask=publish)
        tl.store(ring32_ptr + stat32 + CHANNEL.status_terminal_token // 4, tl.zeros_like(why), mask=publish)
        prog = prog_at // 8 + c * (CHANNEL.progress_bytes // 8)
        held = tl.load(ring64_ptr + prog + CHANNEL.progress_count // 8, mask=publish, other=0, volatile=True)
        fence_sys(ON_GPU)
        tl.debug_barrier()
        store_release(ring64_ptr + prog + CHANNEL.progress_count // 8, held | final_bit, ON_GPU, mask=publish)
        fence_sys(ON_GPU)
        tl.debug_barrier()
        generation = tl.load(generation_ptr + d, mask=publish, other=0)
        store_release(ring64_ptr + prog + CHANNEL.progress_done // 8, generation, ON_GPU, mask=publish)

        top = _release_blocks(
            d, closing, top, block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr, MAX_BLOCKS,
            BLOCK_B, Q,
        )  # fmt: skip
        tl.store(slot_state_ptr + d, tl.full([BLOCK_D], SLOT.FREE, tl.int32), mask=closing)
        tl.store(finish_reason_ptr + d, tl.zeros_like(why), mask=closing)
        tl.store(error_code_ptr + d, tl.zeros_like(err), mask=closing)
        counted = tl.sum((closing & (why != FINISH.ERROR)).to(tl.int64), 0)
    return top, n_closed, counted


@triton.jit
def _release_blocks(
    slots, release, top, block_table_ptr, num_blocks_ptr, free_blocks_ptr, blocks, lru_words_ptr,
    MAX_BLOCKS: tl.constexpr, BLOCK_B: tl.constexpr, Q: tl.constexpr,
):  # fmt: skip
    """The slots in `release` let go of their blocks one after the other in lane order
    (kernels/prefix_cache.py release_one: the stack, or the LRU for cached ones); their tables are
    cleared. The LRU's tail and live count are read and written here (nothing else in commit
    touches them). Returns the stack top."""
    nb = tl.where(release, tl.load(num_blocks_ptr + slots, mask=release, other=0), 0)
    tl.debug_barrier()
    tail = tl.load(lru_words_ptr + 1)
    n_cached = tl.load(lru_words_ptr + 2).to(tl.int32)
    top, tail, n_cached = release_lanes(
        release, tl.arange(0, slots.shape[0]), slots, nb, top, tail, n_cached, block_table_ptr, free_blocks_ptr,
        blocks, MAX_BLOCKS, BLOCK_B, Q,
    )  # fmt: skip
    tl.store(lru_words_ptr + 1, tail)
    tl.store(lru_words_ptr + 2, n_cached.to(tl.int64))
    tl.store(num_blocks_ptr + slots, tl.zeros_like(nb), mask=release)
    tl.debug_barrier()
    return top
