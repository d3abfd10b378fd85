"""The GPU loop's commit step (one Triton program): append sampled tokens, publish them to the ring,
apply the stop rules, publish terminal events, release finished slots and their KV blocks.

State semantics are engine/device_state.py's; the wrapper is engine/device_commit.py; the
publication protocol is docs/protocol.md ("Publication order", GPU paragraph).

1. Sample rows r with sample_slot[r] = s >= 0 and slot s RUNNING: token t = sampled[r], output
   index i = num_tokens[s] - prompt_len[s]; token_ids[s, num_tokens[s]] = t; num_tokens[s] += 1;
   ring tokens[chan, i] = t, times[chan, i] = now. Stop rules in the reference engine's order (EOS
   unless ignore_eos, stop ids -> STOP; max_tokens, max_model_len -> LENGTH). Publication: payload
   (tokens, times; the status record of a finishing row), a system-scope fence by every thread, a
   barrier, then `count` (i + 1, | FINAL_BIT
   when finishing) with a system-scope release store, a barrier, then `done` = generation the
   same way for a finishing row. A row whose output index is past the channel's capacity publishes
   no token and finishes LENGTH (the ring server's rule; admission keeps max_tokens within it).
2. Slots in FINISHING (schedule's cancels, rejected records, shutdown): status (their finish_reason
   / error_code, terminal_token 0), count = the channel's count | FINAL_BIT, done = generation.
3. Every released slot (finished rows first, in row order, then FINISHING slots in slot order)
   pushes its block table onto the free-list stack in reverse (engine/block_allocator.py's order:
   the next pop hands the same ids back in the same order), clears its table to -1 and becomes FREE.
4. Counters: generated_tokens, requests_finished (every terminal except finish_reason ERROR, i.e.
   rejected records); num_active -= released; keep_running = (shutdown_seen == 0). When the
   iteration ran a forward (step_num_tokens > 0): last_step_ns = now - step_start_ns (schedule's
   stamp) and one more step in its step_time_hist bucket (ring_layout.STEP_TIME_BOUNDS_US).

Barriers order the program's own threads. On the H100 (2026-11-23, 64 sequences) the front end read
a channel's count before that step's token and stamp and delivered zeros; the likely cause is that a
release store by one warp after a CTA barrier does not keep another warp's earlier stores to host
memory from arriving after it. So every thread fences its own ring stores at system scope
(`fence.acq_rel.sys`) before the barrier that precedes a publication (not yet run on the GPU:
bench/results/2026-11-23-h100-loop-output-holes.md). The clock is %globaltimer plus
clock_offset_ns on the GPU; under the interpreter (no inline asm) it is host_clock_ns[0], the host
monotonic clock the wrapper stores just before the launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel constants (jit code may read globals only as constexpr); the wrapper checks them against
# ring_layout / device_state.
STATUS_BYTES = tl.constexpr(128)  # CHANNEL_STATUS.itemsize
PROGRESS_BYTES = tl.constexpr(16)  # CHANNEL_PROGRESS.itemsize
FREE = tl.constexpr(0)
RUNNING = tl.constexpr(2)
FINISHING = tl.constexpr(3)
FINISH_STOP = tl.constexpr(1)
FINISH_LENGTH = tl.constexpr(2)
FINISH_ERROR = tl.constexpr(4)


@triton.jit
def _now(host_clock_ptr, clock_offset_ptr, ON_GPU: tl.constexpr):
    if ON_GPU:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        return t + tl.load(clock_offset_ptr)
    else:
        return tl.load(host_clock_ptr)


@triton.jit
def _store_release(ptr, value, mask, ON_GPU: tl.constexpr):
    """Release-store of the u64 words the front end polls (count, done), where `mask`. On the GPU a
    predicated `st.release.sys`: the ring is host memory over PCIe, where system-scope atomics are not
    supported (compute-sanitizer flags them), so the publication is a release store, not an exchange.
    Every thread holding a lane runs the asm (inline asm is not deduplicated): the same value each."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.release.sys.global.u64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r",
            [ptr, value.to(tl.int64), mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptr, value.to(tl.int64), mask=mask)


@triton.jit
def _fence_sys(ON_GPU: tl.constexpr):
    """Every thread: its earlier stores to the ring are visible to the host before its later ones.
    Run before the barrier that precedes a publication: a warp's release store is not relied on to
    order another warp's stores to host memory (on the H100 a channel's count became visible before
    its token and stamp, and the client read zeros; this is the likely cause)."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _release_blocks(
    slots, release, base, block_table_ptr, num_blocks_ptr, free_blocks_ptr,
    MAX_BLOCKS: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Push the block tables of `slots` where `release` onto the free stack from position `base` on,
    one slot after the other in lane order, each table in reverse; clear the tables. Returns the
    number of blocks pushed."""
    nb = tl.where(release, tl.load(num_blocks_ptr + slots, mask=release, other=0), 0)
    start = base + tl.cumsum(nb, 0) - nb
    cols = tl.arange(0, BLOCK_B)
    for j0 in range(0, MAX_BLOCKS, BLOCK_B):
        j = j0 + cols  # j-th pushed block = table[nb - 1 - j]
        live = release[:, None] & (j[None, :] < nb[:, None])
        entry = block_table_ptr + slots[:, None].to(tl.int64) * MAX_BLOCKS + (nb[:, None] - 1 - j[None, :])
        block = tl.load(entry, mask=live, other=-1)
        tl.store(free_blocks_ptr + start[:, None] + j[None, :], block, mask=live)
        tl.store(entry, tl.full(block.shape, -1, tl.int32), mask=live)
    tl.store(num_blocks_ptr + slots, tl.zeros_like(nb), mask=release)
    return tl.sum(nb, 0)


@triton.jit
def _commit_kernel(
    sample_slot_ptr, sampled_ptr,
    slot_state_ptr, chan_ptr, generation_ptr, prompt_len_ptr, num_tokens_ptr, max_tokens_ptr,
    ignore_eos_ptr, n_stop_ptr, stop_ids_ptr, token_ids_ptr, block_table_ptr, num_blocks_ptr,
    finish_reason_ptr, error_code_ptr,
    free_blocks_ptr, free_top_ptr, num_active_ptr, shutdown_seen_ptr, keep_running_ptr,
    clock_offset_ptr, host_clock_ptr, counters_ptr, eos_ptr,
    ring64_ptr, ring32_ptr, tokens_at, times_at, prog_at, stat_at,
    step_start_ptr, step_num_tokens_ptr, step_time_hist_ptr, step_bounds_ptr,
    S, D, max_output_tokens, max_inflight,
    MAX_STOP: tl.constexpr, BLOCK_STOP: tl.constexpr, MAX_EOS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    GENERATED: tl.constexpr, FINISHED: tl.constexpr, LAST_STEP: tl.constexpr,
    NUM_STEP_BUCKETS: tl.constexpr, BLOCK_H: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    now = _now(host_clock_ptr, clock_offset_ptr, ON_GPU)
    final_bit = tl.full([], 1, tl.int64) << 63
    # One-element words this program updates: read here, written once at the end after a barrier
    # (kernels/schedule.py's docstring says why: a store by one thread may beat another warp's load).
    top = tl.load(free_top_ptr)
    generated_before = tl.load(counters_ptr + GENERATED)
    finished_before = tl.load(counters_ptr + FINISHED)
    active_before = tl.load(num_active_ptr)
    h = tl.arange(0, BLOCK_H)
    hist = tl.load(step_time_hist_ptr + h, mask=h < NUM_STEP_BUCKETS, other=0)
    last_step = tl.load(counters_ptr + LAST_STEP)
    ran = tl.load(step_num_tokens_ptr) > 0
    step_ns = now - tl.load(step_start_ptr)
    bounds = tl.load(step_bounds_ptr + h, mask=h < NUM_STEP_BUCKETS - 1, other=0)
    bucket = tl.sum(((h < NUM_STEP_BUCKETS - 1) & (step_ns > bounds)).to(tl.int32), 0)

    # -- 1. sampled rows -----------------------------------------------------------------------------
    r = tl.arange(0, BLOCK_S)
    s = tl.load(sample_slot_ptr + r, mask=r < S, other=-1)
    row = (r < S) & (s >= 0)
    s = tl.where(row, s, 0)
    row = row & (tl.load(slot_state_ptr + s, mask=row, other=FREE) == RUNNING)
    token = tl.load(sampled_ptr + r, mask=row, other=0).to(tl.int32)
    n = tl.load(num_tokens_ptr + s, mask=row, other=0)
    i = n - tl.load(prompt_len_ptr + s, mask=row, other=0)  # output index of this token
    chan = tl.load(chan_ptr + s, mask=row, other=0)
    row = row & (chan >= 0) & (chan < max_inflight)
    chan = chan.to(tl.int64)
    room = row & (i < max_output_tokens)
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
    reason = tl.where(stop, FINISH_STOP, tl.where(length, FINISH_LENGTH, 0))
    reason = tl.where(room, reason, FINISH_LENGTH)  # out of channel capacity: finish without the token
    finished = row & (reason != 0)

    at = chan * max_output_tokens + i
    tl.store(ring32_ptr + tokens_at + at, token, mask=room)
    tl.store(ring64_ptr + times_at + at, tl.zeros_like(at) + now, mask=room)
    stat64 = stat_at // 8 + chan * (STATUS_BYTES // 8)
    stat32 = stat_at // 4 + chan * (STATUS_BYTES // 4)
    tl.store(ring64_ptr + stat64, tl.zeros_like(at) + now, mask=finished)
    tl.store(ring32_ptr + stat32 + 2, reason, mask=finished)
    tl.store(ring32_ptr + stat32 + 3, tl.zeros_like(reason), mask=finished)
    tl.store(ring32_ptr + stat32 + 4, room.to(tl.int32), mask=finished)
    _fence_sys(ON_GPU)
    tl.debug_barrier()
    prog = prog_at // 8 + chan * (PROGRESS_BYTES // 8)
    count = tl.where(room, i + 1, i).to(tl.int64)
    count = tl.where(finished, count | final_bit, count)
    _store_release(ring64_ptr + prog, count, row, ON_GPU)
    _fence_sys(ON_GPU)
    tl.debug_barrier()
    generation = tl.load(generation_ptr + s, mask=finished, other=0)
    _store_release(ring64_ptr + prog + 1, generation, finished, ON_GPU)

    top += _release_blocks(
        s, finished, top, block_table_ptr, num_blocks_ptr, free_blocks_ptr, MAX_BLOCKS, BLOCK_B
    )
    tl.store(slot_state_ptr + s, tl.full([BLOCK_S], FREE, tl.int32), mask=finished)
    generated = tl.sum(room.to(tl.int64), 0)
    n_finished = tl.sum(finished.to(tl.int32), 0)
    tl.debug_barrier()

    # -- 2. FINISHING slots: terminal without a token ---------------------------------------------------
    d = tl.arange(0, BLOCK_D)
    closing = (d < D) & (tl.load(slot_state_ptr + d, mask=d < D, other=FREE) == FINISHING)
    c = tl.load(chan_ptr + d, mask=closing, other=-1)
    publish = closing & (c >= 0) & (c < max_inflight)
    c = tl.where(publish, c, 0).to(tl.int64)
    why = tl.load(finish_reason_ptr + d, mask=closing, other=0)
    err = tl.load(error_code_ptr + d, mask=closing, other=0)
    stat64 = stat_at // 8 + c * (STATUS_BYTES // 8)
    stat32 = stat_at // 4 + c * (STATUS_BYTES // 4)
    tl.store(ring64_ptr + stat64, tl.zeros_like(c) + now, mask=publish)
    tl.store(ring32_ptr + stat32 + 2, why, mask=publish)
    tl.store(ring32_ptr + stat32 + 3, err, mask=publish)
    tl.store(ring32_ptr + stat32 + 4, tl.zeros_like(why), mask=publish)
    prog = prog_at // 8 + c * (PROGRESS_BYTES // 8)
    held = tl.load(ring64_ptr + prog, mask=publish, other=0, volatile=True)
    _fence_sys(ON_GPU)
    tl.debug_barrier()
    _store_release(ring64_ptr + prog, held | final_bit, publish, ON_GPU)
    _fence_sys(ON_GPU)
    tl.debug_barrier()
    generation = tl.load(generation_ptr + d, mask=publish, other=0)
    _store_release(ring64_ptr + prog + 1, generation, publish, ON_GPU)

    top += _release_blocks(
        d, closing, top, block_table_ptr, num_blocks_ptr, free_blocks_ptr, MAX_BLOCKS, BLOCK_B
    )
    tl.store(slot_state_ptr + d, tl.full([BLOCK_D], FREE, tl.int32), mask=closing)
    tl.store(finish_reason_ptr + d, tl.zeros_like(why), mask=closing)
    tl.store(error_code_ptr + d, tl.zeros_like(err), mask=closing)
    n_closed = tl.sum(closing.to(tl.int32), 0)

    # -- 3. counters and loop control ---------------------------------------------------------------------
    counted = tl.sum((closing & (why != FINISH_ERROR)).to(tl.int64), 0) + n_finished
    keep_running = (tl.load(shutdown_seen_ptr) == 0).to(tl.int32)
    tl.debug_barrier()  # every warp has read the words below before one thread writes them
    tl.store(free_top_ptr, top)
    tl.store(counters_ptr + GENERATED, generated_before + generated)
    tl.store(counters_ptr + FINISHED, finished_before + counted)
    tl.store(num_active_ptr, active_before - n_finished - n_closed)
    tl.store(keep_running_ptr, keep_running)
    tl.store(step_time_hist_ptr + h, hist + ((h == bucket) & ran).to(tl.int64), mask=h < NUM_STEP_BUCKETS)
    tl.store(counters_ptr + LAST_STEP, tl.where(ran, step_ns, last_step))


def launch_commit(args: tuple, constexprs: dict) -> None:
    """Launch the one-program commit kernel (engine/device_commit.py builds `args` and `constexprs` once)."""
    _commit_kernel[(1,)](*args, num_warps=4, **constexprs)


def compile_commit(args: tuple, constexprs: dict) -> None:
    """Compile without launching (Triton's warmup), so a later graph capture only records the launch."""
    _commit_kernel.warmup(*args, grid=(1,), num_warps=4, **constexprs)
