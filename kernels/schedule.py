"""The GPU loop's schedule step as one Triton program: ring intake, cancels, batch, forward inputs.

One launch (grid (1,)) does what the CPU side does between two model steps (docs/device_loop.md,
"schedule"): honour the ring's shutdown word, apply client cancels, admit request records from the
ring into free sequence slots (validated exactly like engine_server._decode), pick the step's chunks
the way the reference Scheduler.schedule does (decodes first, prefill chunks in the rest of the token
budget, KV blocks from the device free stack, recompute preemption, then admission of waiting slots
in (priority, arrival) order), and write the forward's StepInputs, the step tables and the per-row
sampling tensors. Everything the host would compute is computed here from device state, so the
launch can sit in a CUDA graph with no host in the loop.

How it is laid out for speed: per-slot state lives in registers as [BLOCK_D] vectors; running
sequences are put in run order once (compaction + an S x S rank, through a small scratch buffer) and
the budget fill is done in vectorized rounds (prefix sums), one round per preemption event, so a step
without preemption is one round. The sequential parts (records of one launch, admissions of waiting
slots) loop over registers with masked reductions; global memory is only touched to gather/scatter.

Ring access (the region is host memory mapped into the GPU, written by another process): every read
is a volatile load; a record's `seq` word is read with acquire semantics before the record; the
consumer words `req_tail` / `arena_tail` are written with release semantics after a CTA barrier, so
every thread's reads of the records and prompts are done before the front end may reuse their space
(docs/protocol.md, "Publication order"). With RING_ASM these are `ld.acquire.sys` / `st.release.sys`
in inline PTX; without (Triton's CPU interpreter, where there is no reordering) plain loads/stores.

Words the program reads and then updates (free_top, next_arrival, next_run_order, the block-table
width in scratch) are loaded once at the start and stored once at the end, after a CTA barrier. The
program runs as several warps, and a one-element store is done by one thread: a store in the middle
could land before another warp has loaded the old value, which that warp would then use for its own
lanes (H100, 2026-11-23: next_run_order stored right after its load gave slots 32+ run orders
already taken, and the rank by run order then scheduled some sequences twice and others not at all).

Ring words the front end may change while the program runs (shutdown, the records' seq words,
arena_head, channels' cancel and generation words) are read once and made uniform through `snap`
(device memory: store, barrier, load) before anything depends on them. A vector smaller than the
program's threads is held by several threads each, and each would load a changing word at its own
moment: warps would disagree on how many records are published or whether a request is cancelled
(H100: records skipped as unaddressable and their requests never answered, blocks leaked).
"""

from __future__ import annotations

import triton
import triton.language as tl

from blink_appliance.engine.device_state import COUNTER_INDEX, SlotState
from blink_appliance.engine.request import FinishReason
from blink_appliance.transport.ring_layout import (
    CHANNEL_CTL,
    CHANNEL_PROGRESS,
    FINISH_CODES,
    ErrorCode,
    RingGeometry,
    RingLayout,
)

# -- the encodings the kernel shares with the rest of the loop (one definition each, imported) -----
_FREE = tl.constexpr(int(SlotState.FREE))
_WAITING = tl.constexpr(int(SlotState.WAITING))
_RUNNING = tl.constexpr(int(SlotState.RUNNING))
_FINISHING = tl.constexpr(int(SlotState.FINISHING))
_ABORT = tl.constexpr(FINISH_CODES[FinishReason.ABORT])
_ERROR = tl.constexpr(FINISH_CODES[FinishReason.ERROR])
_E_BAD_RECORD = tl.constexpr(int(ErrorCode.BAD_RECORD))
_E_PROMPT_LENGTH = tl.constexpr(int(ErrorCode.PROMPT_LENGTH))
_E_TOKEN = tl.constexpr(int(ErrorCode.TOKEN_OUT_OF_VOCAB))
_E_STOP_IDS = tl.constexpr(int(ErrorCode.STOP_IDS))
_E_MAX_TOKENS = tl.constexpr(int(ErrorCode.MAX_TOKENS))
_E_INVALID_PARAMS = tl.constexpr(int(ErrorCode.INVALID_PARAMS))
_E_ENGINE_REJECTED = tl.constexpr(int(ErrorCode.ENGINE_REJECTED))
_E_SHUTDOWN = tl.constexpr(int(ErrorCode.SHUTDOWN))
# Record outcomes inside the kernel besides "admitted" (0) and an ErrorCode (> 0).
_UNADDRESSABLE = tl.constexpr(-1)
_CANCELLED = tl.constexpr(1000)

_C_LOOP = tl.constexpr(COUNTER_INDEX["loop_iterations"])
_C_STEPS = tl.constexpr(COUNTER_INDEX["steps"])
_C_PREEMPT = tl.constexpr(COUNTER_INDEX["preemptions"])
_C_ADMITTED = tl.constexpr(COUNTER_INDEX["requests_admitted"])
_C_REJECTED = tl.constexpr(COUNTER_INDEX["requests_rejected"])
_C_CANCELLED = tl.constexpr(COUNTER_INDEX["requests_cancelled"])
_C_STEP_TOKENS = tl.constexpr(COUNTER_INDEX["step_tokens"])
_C_UNADDRESSABLE = tl.constexpr(COUNTER_INDEX["records_unaddressable"])

# Byte offsets that do not depend on the ring geometry (the request record's fields up to stop_ids,
# the control words, the channel words). DeviceScheduler checks them against the layout it is given.
REQUEST_FIELD_OFFSETS = {name: spec[1] for name, spec in RingLayout.of(RingGeometry()).request.fields.items()}
_F_RID = tl.constexpr(REQUEST_FIELD_OFFSETS["request_id"])
_F_GEN = tl.constexpr(REQUEST_FIELD_OFFSETS["generation"])
_F_OFFSET = tl.constexpr(REQUEST_FIELD_OFFSETS["prompt_offset"])
_F_END = tl.constexpr(REQUEST_FIELD_OFFSETS["arena_end"])
_F_SEED = tl.constexpr(REQUEST_FIELD_OFFSETS["seed"])
_F_CHAN = tl.constexpr(REQUEST_FIELD_OFFSETS["slot"])
_F_PRIORITY = tl.constexpr(REQUEST_FIELD_OFFSETS["priority"])
_F_PLEN = tl.constexpr(REQUEST_FIELD_OFFSETS["prompt_len"])
_F_MAX_TOKENS = tl.constexpr(REQUEST_FIELD_OFFSETS["max_tokens"])
_F_TEMPERATURE = tl.constexpr(REQUEST_FIELD_OFFSETS["temperature"])
_F_TOP_P = tl.constexpr(REQUEST_FIELD_OFFSETS["top_p"])
_F_MIN_P = tl.constexpr(REQUEST_FIELD_OFFSETS["min_p"])
_F_TOP_K = tl.constexpr(REQUEST_FIELD_OFFSETS["top_k"])
_F_HAS_SEED = tl.constexpr(REQUEST_FIELD_OFFSETS["has_seed"])
_F_IGNORE_EOS = tl.constexpr(REQUEST_FIELD_OFFSETS["ignore_eos"])
_F_N_STOP = tl.constexpr(REQUEST_FIELD_OFFSETS["n_stop"])
_F_STOP_IDS = tl.constexpr(REQUEST_FIELD_OFFSETS["stop_ids"])
_OFF_REQ_TAIL = tl.constexpr(RingLayout.control("req_tail"))
_OFF_ARENA_HEAD = tl.constexpr(RingLayout.control("arena_head"))
_OFF_ARENA_TAIL = tl.constexpr(RingLayout.control("arena_tail"))
_OFF_SHUTDOWN = tl.constexpr(RingLayout.control("shutdown"))
_CTL_BYTES = tl.constexpr(CHANNEL_CTL.itemsize)
_CTL_GENERATION = tl.constexpr(CHANNEL_CTL.fields["generation"][1])
_CTL_CANCEL = tl.constexpr(CHANNEL_CTL.fields["cancel"][1])
_PROG_BYTES = tl.constexpr(CHANNEL_PROGRESS.itemsize)
_PROG_DONE = tl.constexpr(CHANNEL_PROGRESS.fields["done"][1])

# splitmix64 constants as int64 bit patterns (engine/rng.py): the derived seed of a request without one.
_GAMMA = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = tl.constexpr(0x94D049BB133111EB - (1 << 64))
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT64_MAX = tl.constexpr(2**63 - 1)


# -- ring access ----------------------------------------------------------------------------------
@triton.jit
def _load_acquire(ptr, RING_ASM: tl.constexpr):
    """Acquire-load of u64 words another process publishes with a release store: reads issued after
    it (and, after a CTA barrier, every thread's reads) see the payload written before the word."""
    if RING_ASM:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.load(ptr, volatile=True)


@triton.jit
def _store_release(ptr, value, RING_ASM: tl.constexpr):
    """Release-store of a u64 word: the caller puts a CTA barrier first, so the reads of every thread
    (records, prompts) are ordered before the store by cumulativity; the front end acquires it."""
    if RING_ASM:
        tl.inline_asm_elementwise(
            "st.release.sys.global.u64 [$1], $2; mov.u32 $0, 0;",
            "=r,l,l",
            [ptr, value.to(tl.int64)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptr, value.to(tl.int64))


# -- helpers (called a few times per launch: under the interpreter each call of a jit helper is slow)
@triton.jit
def _derived_seed(engine_seed, request_id):
    """mix(engine_seed + (request_id + 1) * GAMMA) with the top bit cleared: rng.row_keys of
    (engine_seed, request_id), so the host can recompute it; in [0, 2**63) like a client seed."""
    z = engine_seed + (request_id + 1) * _GAMMA
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return z & _INT64_MAX


# -- the KV block free stack -------------------------------------------------------------------------
@triton.jit
def _push_blocks(
    release, count, base, slot, block_table_ptr, free_blocks_ptr, MAXB: tl.constexpr, BLOCK_J: tl.constexpr
):
    """Return the first `count` blocks of each releasing slot's table to the free stack, the table
    reversed at free_blocks[base ...] (BlockAllocator.free: the next pops hand them out in table
    order), and clear those table entries to -1."""
    count = tl.where(release, count, 0)
    jj = tl.arange(0, BLOCK_J)
    longest = tl.max(count, 0)
    for j0 in range(0, longest, BLOCK_J):
        j = j0 + jj
        m = j[None, :] < count[:, None]
        entry = block_table_ptr + slot[:, None] * MAXB + (count[:, None] - 1 - j[None, :])
        blocks = tl.load(entry, mask=m, other=-1)
        tl.store(free_blocks_ptr + base[:, None] + j[None, :], blocks, mask=m)
        tl.store(entry, tl.full(blocks.shape, -1, tl.int32), mask=m)


@triton.jit
def _pop_blocks(
    take, count, offset, slot, num_blocks, top, block_table_ptr, free_blocks_ptr,
    MAXB: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Hand each taking slot `count` blocks: its j-th new block is free_blocks[top - 1 - offset - j]
    (the stack popped in the order of `offset`), appended to its table after `num_blocks` entries."""
    count = tl.where(take, count, 0)
    jj = tl.arange(0, BLOCK_J)
    longest = tl.max(count, 0)
    for j0 in range(0, longest, BLOCK_J):
        j = j0 + jj
        m = j[None, :] < count[:, None]
        blocks = tl.load(free_blocks_ptr + (top - 1 - offset[:, None] - j[None, :]), mask=m, other=-1)
        tl.store(block_table_ptr + slot[:, None] * MAXB + num_blocks[:, None] + j[None, :], blocks, mask=m)


@triton.jit
def _release_slots(release, num_blocks, top, offs, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J):
    """Release all blocks of the slots in `release`, in slot order; returns the new stack top."""
    count = tl.where(release, num_blocks, 0)
    base = top + tl.cumsum(count, 0) - count
    _push_blocks(release, count, base, offs, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J)
    return top + tl.sum(count, 0)


# -- the kernel --------------------------------------------------------------------------------------
@triton.jit
def schedule_kernel(
    ring_ptr,
    # DeviceState, per slot
    slot_state_ptr, chan_ptr, generation_ptr, request_id_ptr, priority_ptr, arrival_ptr, run_order_ptr,
    prompt_len_ptr, num_tokens_ptr, num_computed_ptr, max_tokens_ptr, temperature_ptr, top_p_ptr,
    top_k_ptr, min_p_ptr, seed_ptr, ignore_eos_ptr, n_stop_ptr, stop_ids_ptr, token_ids_ptr,
    block_table_ptr, num_blocks_ptr, finish_reason_ptr, error_code_ptr,
    # DeviceState, free stack, step tables, sampling rows, control
    free_blocks_ptr, free_top_ptr, step_slot_ptr, step_chunk_ptr, sample_slot_ptr, step_num_tokens_ptr,
    bucket_index_ptr, sampler_index_ptr, row_temperature_ptr, row_top_k_ptr, row_top_p_ptr, row_min_p_ptr,
    row_seed_ptr, row_output_index_ptr, num_active_ptr, shutdown_seen_ptr, next_arrival_ptr,
    next_run_order_ptr, counters_ptr,
    # GpuForward.inputs (StepInputs)
    input_ids_ptr, positions_ptr, slot_mapping_ptr, query_start_ptr, context_lens_ptr, block_tables_ptr,
    sample_rows_ptr,
    # the scheduler's own: bucket sizes, scratch, seed for requests without one
    buckets_ptr, scratch_ptr, snap_ptr, engine_seed,
    # the step's start time: %globaltimer + clock_offset on the GPU, else the host clock (interpreter)
    step_start_ptr, clock_offset_ptr, host_clock_ptr,
    # loop geometry
    D: tl.constexpr, S: tl.constexpr, MAX_BATCHED: tl.constexpr, NUM_BUCKETS: tl.constexpr,
    BS: tl.constexpr, MAXB: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, VOCAB: tl.constexpr,
    NUM_COUNTERS: tl.constexpr,
    # ring geometry and section offsets
    REQ_SLOTS: tl.constexpr, ARENA_TOKENS: tl.constexpr, MAX_PROMPT: tl.constexpr,
    MAX_INFLIGHT: tl.constexpr, MAX_OUTPUT: tl.constexpr, MAX_STOP: tl.constexpr,
    OFF_RECORDS: tl.constexpr, REC_BYTES: tl.constexpr, OFF_ARENA: tl.constexpr, OFF_CTL: tl.constexpr,
    OFF_PROG: tl.constexpr,
    # tile sizes
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_S1: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_STOP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_NC: tl.constexpr,
    RING_ASM: tl.constexpr,
):  # fmt: skip
    # Typed views of the region (every field is naturally aligned: ring_layout checks it); offsets
    # below are in bytes, divided by the word size at the use.
    ring_i64 = ring_ptr.to(tl.pointer_type(tl.int64))
    ring_i32 = ring_ptr.to(tl.pointer_type(tl.int32))
    ring_u32 = ring_ptr.to(tl.pointer_type(tl.uint32))  # loaded zero-extended: a huge u32 stays huge
    ring_f64 = ring_ptr.to(tl.pointer_type(tl.float64))
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    st = tl.load(slot_state_ptr + offs_d, mask=md, other=_FREE)
    nb_d = tl.load(num_blocks_ptr + offs_d, mask=md, other=0)
    ch_d = tl.load(chan_ptr + offs_d, mask=md, other=-1)
    gen_d = tl.load(generation_ptr + offs_d, mask=md, other=0)
    # The step's start, for commit's step time (nothing here reads it back).
    if RING_ASM:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        ) + tl.load(clock_offset_ptr)
    else:
        now = tl.load(host_clock_ptr)
    tl.store(step_start_ptr, now)
    # Read here, written back once at the end (module docstring: one-element updates and warps).
    top = tl.load(free_top_ptr)
    next_arrival = tl.load(next_arrival_ptr)
    next_run_order = tl.load(next_run_order_ptr)
    table_width = tl.load(scratch_ptr + BLOCK_D + BLOCK_S)  # block-table columns the last forward used

    # Every read of the ring a step needs, issued up front so that their bus round trips overlap
    # (about two in all: the control words and cancel words, then the records at req_tail).
    shutdown = tl.load(ring_i64 + _OFF_SHUTDOWN // 8, volatile=True)
    tail = tl.load(ring_i64 + _OFF_REQ_TAIL // 8, volatile=True)
    arena_tail = tl.load(ring_i64 + _OFF_ARENA_TAIL // 8, volatile=True)
    live = md & ((st == _WAITING) | (st == _RUNNING))
    addressable = live & (ch_d >= 0) & (ch_d < MAX_INFLIGHT)
    cancel_word = tl.load(
        ring_i64 + (OFF_CTL + ch_d.to(tl.int64) * _CTL_BYTES + _CTL_CANCEL) // 8,
        mask=addressable, other=0, volatile=True,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    position = tail + offs_r
    rec = OFF_RECORDS + (position % REQ_SLOTS) * REC_BYTES
    seq_word = _load_acquire(ring_i64 + rec // 8, RING_ASM)
    # One value per word for every thread (module docstring): snap[0] shutdown, [2, +BLOCK_R) seq
    # words, [2 + BLOCK_R, +BLOCK_D) cancel words of the live slots' channels.
    tl.store(snap_ptr, shutdown)
    tl.store(snap_ptr + 2 + offs_r, seq_word)
    tl.store(snap_ptr + 2 + BLOCK_R + offs_d, cancel_word)
    tl.debug_barrier()
    shutdown = tl.load(snap_ptr, volatile=True)
    seq_word = tl.load(snap_ptr + 2 + offs_r, volatile=True)
    cancel_word = tl.load(snap_ptr + 2 + BLOCK_R + offs_d, volatile=True)

    # What the step ends up with (the shutdown branch leaves them empty).
    nseq = tl.full([], 0, tl.int32)  # sequences in the batch
    ntot = tl.full([], 0, tl.int32)  # tokens in the step
    nsamp = tl.full([], 0, tl.int32)  # sample rows
    any_random = tl.full([], 0, tl.int32)
    n_preempted = tl.full([], 0, tl.int32)
    n_admitted = tl.full([], 0, tl.int32)
    n_rejected = tl.full([], 0, tl.int32)
    n_cancelled = tl.full([], 0, tl.int32)
    n_unaddressable = tl.full([], 0, tl.int32)

    if shutdown != 0:
        # 1. Shutdown: every live slot ends with ABORT / SHUTDOWN; nothing is admitted or scheduled.
        # Records still in the ring stay there for the host to drain once the loop has ended.
        top = _release_slots(live, nb_d, top, offs_d, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J)
        tl.store(slot_state_ptr + offs_d, tl.full([BLOCK_D], _FINISHING, tl.int32), mask=live)
        tl.store(finish_reason_ptr + offs_d, tl.full([BLOCK_D], _ABORT, tl.int32), mask=live)
        tl.store(error_code_ptr + offs_d, tl.full([BLOCK_D], _E_SHUTDOWN, tl.int32), mask=live)
        tl.store(num_blocks_ptr + offs_d, tl.zeros([BLOCK_D], tl.int32), mask=live)
        tl.store(shutdown_seen_ptr, 1)
    else:
        # 2. Cancels: a live slot whose channel's cancel word equals its generation.
        cancelled = addressable & (cancel_word == gen_d)
        n_cancelled = tl.sum(cancelled.to(tl.int32), 0)
        if n_cancelled > 0:
            top = _release_slots(
                cancelled, nb_d, top, offs_d, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J
            )
            tl.store(slot_state_ptr + offs_d, tl.full([BLOCK_D], _FINISHING, tl.int32), mask=cancelled)
            tl.store(finish_reason_ptr + offs_d, tl.full([BLOCK_D], _ABORT, tl.int32), mask=cancelled)
            tl.store(error_code_ptr + offs_d, tl.zeros([BLOCK_D], tl.int32), mask=cancelled)
            tl.store(num_blocks_ptr + offs_d, tl.zeros([BLOCK_D], tl.int32), mask=cancelled)
            st = tl.where(cancelled, _FINISHING, st)

        # 3. Records from the ring: the published run starting at req_tail, at most one per free slot.
        unpublished = (seq_word != position + 1).to(tl.int32)
        published = tl.sum((tl.cumsum(unpublished, 0) == 0).to(tl.int32), 0)
        free_d = md & (st == _FREE)
        n_records = tl.minimum(published, tl.sum(free_d.to(tl.int32), 0))
        if n_records > 0:
            tl.debug_barrier()  # every thread's reads below come after some thread's acquire of seq
            tk = offs_r < n_records
            r_rid = tl.load(ring_i64 + (rec + _F_RID) // 8, mask=tk, other=0, volatile=True)
            r_gen = tl.load(ring_i64 + (rec + _F_GEN) // 8, mask=tk, other=0, volatile=True)
            r_off = tl.load(ring_i64 + (rec + _F_OFFSET) // 8, mask=tk, other=0, volatile=True)
            r_end = tl.load(ring_i64 + (rec + _F_END) // 8, mask=tk, other=0, volatile=True)
            r_seed = tl.load(ring_i64 + (rec + _F_SEED) // 8, mask=tk, other=0, volatile=True)
            r_chan = tl.load(ring_u32 + (rec + _F_CHAN) // 4, volatile=True).to(tl.int64)
            r_prio = tl.load(ring_i32 + (rec + _F_PRIORITY) // 4, mask=tk, other=0, volatile=True)
            r_plen = tl.load(ring_u32 + (rec + _F_PLEN) // 4, volatile=True).to(tl.int64)
            r_max_tokens = tl.load(ring_u32 + (rec + _F_MAX_TOKENS) // 4, volatile=True).to(tl.int64)
            r_temp = tl.load(ring_f64 + (rec + _F_TEMPERATURE) // 8, mask=tk, other=0.0, volatile=True)
            r_top_p = tl.load(ring_f64 + (rec + _F_TOP_P) // 8, mask=tk, other=1.0, volatile=True)
            r_min_p = tl.load(ring_f64 + (rec + _F_MIN_P) // 8, mask=tk, other=0.0, volatile=True)
            r_top_k = tl.load(ring_i32 + (rec + _F_TOP_K) // 4, mask=tk, other=0, volatile=True)
            r_has_seed = tl.load(ring_u32 + (rec + _F_HAS_SEED) // 4, volatile=True).to(tl.int64)
            r_ignore_eos = tl.load(ring_u32 + (rec + _F_IGNORE_EOS) // 4, volatile=True).to(tl.int64)
            r_n_stop = tl.load(ring_u32 + (rec + _F_N_STOP) // 4, volatile=True).to(tl.int64)
            arena_head = tl.load(ring_i64 + _OFF_ARENA_HEAD // 8, volatile=True)
            on_chan = tk & (r_chan < MAX_INFLIGHT)
            c_gen = tl.load(
                ring_i64 + (OFF_CTL + r_chan * _CTL_BYTES + _CTL_GENERATION) // 8,
                mask=on_chan, other=0, volatile=True,
            )  # fmt: skip
            c_cancel = tl.load(
                ring_i64 + (OFF_CTL + r_chan * _CTL_BYTES + _CTL_CANCEL) // 8,
                mask=on_chan, other=0, volatile=True,
            )  # fmt: skip
            p_done = tl.load(
                ring_i64 + (OFF_PROG + r_chan * _PROG_BYTES + _PROG_DONE) // 8,
                mask=on_chan, other=0, volatile=True,
            )  # fmt: skip
            # The front end's words among these, made uniform (snap[1] arena_head, then per record
            # its channel's generation and cancel words after the first 2 + BLOCK_R + BLOCK_D).
            at = 2 + BLOCK_R + BLOCK_D
            tl.store(snap_ptr + 1, arena_head)
            tl.store(snap_ptr + at + offs_r, c_gen)
            tl.store(snap_ptr + at + BLOCK_R + offs_r, c_cancel)
            tl.debug_barrier()
            arena_head = tl.load(snap_ptr + 1, volatile=True)
            c_gen = tl.load(snap_ptr + at + offs_r, volatile=True)
            c_cancel = tl.load(snap_ptr + at + BLOCK_R + offs_r, volatile=True)
            # Checks that need nothing but the record, in engine_server's order. The ones that depend
            # on earlier records (channel in use, duplicate id, arena_tail, prompt tokens) come below.
            local = tl.where(
                (r_chan >= MAX_INFLIGHT) | (r_gen == 0) | (c_gen != r_gen) | (p_done == r_gen), 1,
                tl.where((r_plen < 1) | (r_plen > MAX_PROMPT), 2,
                tl.where((r_off < 0) | (r_end != r_off + r_plen) | (r_end > arena_head)
                         | ((r_off % ARENA_TOKENS) + r_plen > ARENA_TOKENS), 3, 0)),
            )  # fmt: skip
            jj = tl.arange(0, BLOCK_STOP)
            stop_m = tk[:, None] & (jj[None, :] < tl.minimum(r_n_stop, MAX_STOP)[:, None])
            stop_ids = tl.load(
                ring_i32 + (rec[:, None] + _F_STOP_IDS + 4 * jj[None, :]) // 4,
                mask=stop_m,
                other=0,
                volatile=True,
            )
            stop_bad = tl.sum((stop_m & ((stop_ids < 0) | (stop_ids >= VOCAB))).to(tl.int32), 1) > 0
            inf = float("inf")
            finite = (
                (r_temp == r_temp) & (tl.abs(r_temp) < inf) & (r_top_p == r_top_p) & (tl.abs(r_top_p) < inf)
                & (r_min_p == r_min_p) & (tl.abs(r_min_p) < inf)
            )  # fmt: skip
            params_bad = (
                (r_has_seed > 1) | (r_ignore_eos > 1) | ~finite
                | ~(r_temp >= 0.0) | ~((r_top_p > 0.0) & (r_top_p <= 1.0)) | (r_top_k < 0)
                | ~((r_min_p >= 0.0) & (r_min_p <= 1.0)) | ((r_has_seed == 1) & (r_seed < 0))
            )  # fmt: skip
            # After the prompt checks: _decode's remaining checks, then the cancel word, then
            # LLMEngine.add_request's length limit.
            later = tl.where(r_n_stop > MAX_STOP, _E_STOP_IDS,
                    tl.where(stop_bad, _E_STOP_IDS,
                    tl.where((r_max_tokens < 1) | (r_max_tokens > MAX_OUTPUT), _E_MAX_TOKENS,
                    tl.where(params_bad, _E_INVALID_PARAMS,
                    tl.where(c_cancel == r_gen, _CANCELLED,
                    tl.where(r_plen > MAX_MODEL_LEN, _E_ENGINE_REJECTED, 0))))))  # fmt: skip

            # One record at a time, in ring order, against the slots as the earlier records left them.
            nonfree = md & (st != _FREE)
            live_req = md & ((st == _WAITING) | (st == _RUNNING))
            rid_d = tl.load(request_id_ptr + offs_d, mask=md, other=0)
            r_slot = tl.full([BLOCK_R], -1, tl.int32)
            r_outcome = tl.zeros([BLOCK_R], tl.int32)
            offs_p = tl.arange(0, BLOCK_P)
            for r in range(0, n_records):
                is_r = offs_r == r
                c = tl.sum(tl.where(is_r, r_chan, 0), 0)
                rid = tl.sum(tl.where(is_r, r_rid, 0), 0)
                off = tl.sum(tl.where(is_r, r_off, 0), 0)
                plen = tl.sum(tl.where(is_r, r_plen, 0), 0)
                loc = tl.sum(tl.where(is_r, local, 0), 0)
                unaddressable = (loc == 1) | (
                    tl.sum((nonfree & (ch_d.to(tl.int64) == c)).to(tl.int32), 0) > 0
                )
                s = tl.min(tl.where(free_d, offs_d, BLOCK_D), 0)
                duplicate = tl.sum((live_req & (rid_d == rid)).to(tl.int32), 0) > 0
                code = tl.where(duplicate, _E_BAD_RECORD,
                       tl.where(loc == 2, _E_PROMPT_LENGTH,
                       tl.where((loc == 3) | (off < arena_tail), _E_BAD_RECORD, 0)))  # fmt: skip
                # Copy the prompt into the slot while checking its ids (only a validated arena range).
                n_copy = tl.where(unaddressable | (code != 0), 0, plen)
                src = OFF_ARENA + 4 * (off % ARENA_TOKENS)
                bad_token = tl.full([], 0, tl.int32)
                for p0 in range(0, n_copy, BLOCK_P):
                    p = p0 + offs_p
                    pm = p < n_copy
                    tok = tl.load(ring_i32 + (src + 4 * p) // 4, mask=pm, other=0, volatile=True)
                    bad_token = tl.maximum(
                        bad_token, tl.sum((pm & ((tok < 0) | (tok >= VOCAB))).to(tl.int32), 0)
                    )
                    tl.store(token_ids_ptr + s * MAX_MODEL_LEN + p, tok, mask=pm & (p < MAX_MODEL_LEN))
                code = tl.where((code == 0) & (bad_token > 0), _E_TOKEN, code)
                code = tl.where(code == 0, tl.sum(tl.where(is_r, later, 0), 0), code)
                taken = (offs_d == s) & ~unaddressable
                free_d = free_d & ~taken
                nonfree = nonfree | taken
                ch_d = tl.where(taken, c.to(tl.int32), ch_d)
                admitted = taken & (code == 0)
                live_req = live_req | admitted
                rid_d = tl.where(admitted, rid, rid_d)
                r_slot = tl.where(is_r & ~unaddressable, s, r_slot)
                r_outcome = tl.where(is_r, tl.where(unaddressable, _UNADDRESSABLE, code), r_outcome)
                # engine_server._release_arena, for every record (also unaddressable ones).
                arena_tail = tl.minimum(
                    tl.maximum(tl.sum(tl.where(is_r, r_end, 0), 0), arena_tail), arena_head
                )

            # Fill the slots the records took: WAITING for admitted ones, FINISHING (commit publishes
            # the terminal event) for rejected and cancelled ones.
            took = tk & (r_slot >= 0)
            adm_r = took & (r_outcome == 0)
            cancelled_r = took & (r_outcome == _CANCELLED)
            rejected_r = took & (r_outcome > 0) & (r_outcome != _CANCELLED)
            n_admitted = tl.sum(adm_r.to(tl.int32), 0)
            n_rejected = tl.sum(rejected_r.to(tl.int32), 0)
            n_cancelled += tl.sum(cancelled_r.to(tl.int32), 0)
            n_unaddressable = tl.sum((tk & (r_outcome == _UNADDRESSABLE)).to(tl.int32), 0)
            sl = tl.where(took, r_slot, 0)
            plen_kept = tl.where(adm_r, r_plen, 0).to(tl.int32)
            seed = tl.where(r_has_seed == 1, r_seed, _derived_seed(engine_seed, r_rid))
            tl.store(slot_state_ptr + sl, tl.where(adm_r, _WAITING, _FINISHING), mask=took)
            tl.store(
                finish_reason_ptr + sl, tl.where(adm_r, 0, tl.where(cancelled_r, _ABORT, _ERROR)), mask=took
            )
            tl.store(error_code_ptr + sl, tl.where(rejected_r, r_outcome, 0), mask=took)
            tl.store(chan_ptr + sl, r_chan.to(tl.int32), mask=took)
            tl.store(generation_ptr + sl, r_gen, mask=took)
            tl.store(request_id_ptr + sl, r_rid, mask=took)
            tl.store(priority_ptr + sl, r_prio, mask=took)
            tl.store(
                arrival_ptr + sl,
                next_arrival + (tl.cumsum(adm_r.to(tl.int64), 0) - adm_r.to(tl.int64)),
                mask=took,
            )
            tl.store(prompt_len_ptr + sl, plen_kept, mask=took)
            tl.store(num_tokens_ptr + sl, plen_kept, mask=took)
            tl.store(num_computed_ptr + sl, tl.zeros([BLOCK_R], tl.int32), mask=took)
            tl.store(num_blocks_ptr + sl, tl.zeros([BLOCK_R], tl.int32), mask=took)
            tl.store(max_tokens_ptr + sl, r_max_tokens.to(tl.int32), mask=adm_r)
            tl.store(temperature_ptr + sl, r_temp.to(tl.float32), mask=adm_r)
            tl.store(top_p_ptr + sl, r_top_p.to(tl.float32), mask=adm_r)
            tl.store(top_k_ptr + sl, r_top_k, mask=adm_r)
            tl.store(min_p_ptr + sl, r_min_p.to(tl.float32), mask=adm_r)
            tl.store(seed_ptr + sl, seed, mask=adm_r)
            tl.store(ignore_eos_ptr + sl, r_ignore_eos.to(tl.int32), mask=adm_r)
            tl.store(n_stop_ptr + sl, r_n_stop.to(tl.int32), mask=adm_r)
            stop_row = tl.where(stop_m, stop_ids, -1)
            tl.store(
                stop_ids_ptr + sl[:, None] * MAX_STOP + jj[None, :],
                stop_row,
                mask=adm_r[:, None] & (jj[None, :] < MAX_STOP),
            )
            next_arrival += n_admitted
            # All reads of the records and their prompts are done (barrier); then hand the space back.
            tl.debug_barrier()
            _store_release(ring_i64 + _OFF_REQ_TAIL // 8, tail + n_records, RING_ASM)
            _store_release(ring_i64 + _OFF_ARENA_TAIL // 8, arena_tail, RING_ASM)
            st = tl.load(slot_state_ptr + offs_d, mask=md, other=_FREE)

        # 4a. Running slots in run order: compact them (slot order), rank by run_order, reorder.
        running = md & (st == _RUNNING)
        running_i = running.to(tl.int32)
        m = tl.sum(running_i, 0)
        tl.store(scratch_ptr + tl.cumsum(running_i, 0) - running_i, offs_d, mask=running)
        tl.debug_barrier()
        ms = offs_s < m
        compact = tl.load(scratch_ptr + offs_s, mask=ms, other=0)
        ro = tl.load(run_order_ptr + compact, mask=ms, other=0)
        rank = tl.sum((ms[None, :] & (ro[None, :] < ro[:, None])).to(tl.int32), 1)
        tl.store(scratch_ptr + BLOCK_D + rank, compact, mask=ms)
        tl.debug_barrier()
        ks = tl.load(scratch_ptr + BLOCK_D + offs_s, mask=ms, other=0)  # slot of the k-th running sequence
        ntok_k = tl.load(num_tokens_ptr + ks, mask=ms, other=0)
        ncomp_k = tl.load(num_computed_ptr + ks, mask=ms, other=0)
        nb_k = tl.load(num_blocks_ptr + ks, mask=ms, other=0)
        rem_k = ntok_k - ncomp_k

        # 4b. The budget fill (Scheduler.schedule phase 1) in rounds. A round schedules sequences
        # i0..hi as if no preemption happened: decodes 1 token, prefills greedily from what the budget
        # leaves after one token per decode (= the reference's `reserved`), blocks from the stack top
        # by prefix sums. The first sequence whose blocks do not fit ends the round: the sequences
        # before it keep their chunks, the most recent ones (from hi down) are preempted until it fits
        # or it is itself the victim, and the next round starts after it.
        n_k = tl.zeros([BLOCK_S], tl.int32)
        pre_k = tl.zeros([BLOCK_S], tl.int32)
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
            kstar = tl.min(tl.where(act & (cum_need > top), offs_s, BLOCK_S), 0)
            ok = act & (offs_s < kstar)
            _pop_blocks(
                ok, need, cum_need - need, ks, nb_k, top, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J
            )
            top -= tl.sum(tl.where(ok, need, 0), 0)
            budget -= tl.sum(tl.where(ok, n, 0), 0)
            n_k = tl.where(ok, n, n_k)
            nb_k = tl.where(ok, nb_k + need, nb_k)
            if kstar < BLOCK_S:
                is_k = offs_s == kstar
                need_k = tl.sum(tl.where(is_k, need, 0), 0)
                n_star = tl.sum(tl.where(is_k, n, 0), 0)
                behind = (offs_s > kstar) & (offs_s <= hi)
                blocks_from = tl.cumsum(tl.where(behind, nb_k, 0), 0, reverse=True)  # freed by victims j..hi
                enough = behind & (top + blocks_from >= need_k)
                first_victim = tl.max(tl.where(enough, offs_s, -1), 0)
                survives = first_victim >= 0
                first_victim = tl.where(survives, first_victim, kstar)
                victim = (offs_s >= first_victim) & (offs_s <= hi)
                freed = tl.where(victim, nb_k, 0)
                tl.debug_barrier()  # the pops above have read their stack entries
                _push_blocks(
                    victim, freed, top + tl.cumsum(freed, 0, reverse=True) - freed, ks,
                    block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J,
                )  # fmt: skip
                top += tl.sum(freed, 0)
                pre_k = tl.where(victim, 1, pre_k)
                nb_k = tl.where(victim, 0, nb_k)
                tl.debug_barrier()  # the victims' blocks are on the stack before kstar pops them
                take = is_k & survives
                _pop_blocks(take, need, tl.zeros([BLOCK_S], tl.int32), ks, nb_k, top,
                            block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J)  # fmt: skip
                top -= tl.where(survives, need_k, 0)
                budget -= tl.where(survives, n_star, 0)
                n_k = tl.where(take, n, n_k)
                nb_k = tl.where(take, nb_k + need, nb_k)
                hi = first_victim - 1
                i0 = kstar + 1
            else:
                i0 = hi + 1
        n_preempted = tl.sum((pre_k != 0).to(tl.int32), 0)
        preempted = ms & (pre_k != 0)
        tl.store(num_computed_ptr + ks, tl.where(preempted, 0, ncomp_k + n_k), mask=ms)
        tl.store(num_blocks_ptr + ks, nb_k, mask=ms)
        tl.store(slot_state_ptr + ks, tl.where(preempted, _WAITING, _RUNNING), mask=ms)

        # The running part of the batch, in run order.
        sched_k = n_k > 0
        bi_k = tl.cumsum(sched_k.to(tl.int32), 0) - sched_k.to(tl.int32)
        qs_k = tl.cumsum(n_k, 0) - n_k
        samples_k = sched_k & (ncomp_k + n_k == ntok_k)
        row_k = tl.cumsum(samples_k.to(tl.int32), 0) - samples_k.to(tl.int32)
        nseq = tl.sum(sched_k.to(tl.int32), 0)
        ntot = tl.sum(n_k, 0)
        nsamp = tl.sum(samples_k.to(tl.int32), 0)
        tl.store(step_slot_ptr + bi_k, ks, mask=sched_k)
        tl.store(step_chunk_ptr + bi_k, n_k, mask=sched_k)
        tl.store(query_start_ptr + bi_k, qs_k, mask=sched_k)
        tl.store(context_lens_ptr + bi_k, ncomp_k + n_k, mask=sched_k)
        any_random = _write_sample_rows(
            samples_k, row_k, ks, (qs_k + n_k - 1).to(tl.int64), sample_slot_ptr, sample_rows_ptr,
            temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, num_tokens_ptr, prompt_len_ptr,
            row_temperature_ptr, row_top_k_ptr, row_top_p_ptr, row_min_p_ptr, row_seed_ptr, row_output_index_ptr,
        )  # fmt: skip

        # 4c. Admission of waiting slots (phase 2), only in a step without preemption: the head of
        # the (priority, arrival) order while there are sequences, budget and blocks for its chunk.
        waiting = md & (st == _WAITING)
        pri_d = tl.load(priority_ptr + offs_d, mask=md, other=0)
        arr_d = tl.load(arrival_ptr + offs_d, mask=md, other=0)
        ntok_d = tl.load(num_tokens_ptr + offs_d, mask=md, other=0)
        adm_rank = tl.full([BLOCK_D], -1, tl.int32)
        adm_n = tl.zeros([BLOCK_D], tl.int32)
        adm_need = tl.zeros([BLOCK_D], tl.int32)
        adm_off = tl.zeros([BLOCK_D], tl.int32)
        adm_qs = tl.zeros([BLOCK_D], tl.int32)
        adm_row = tl.full([BLOCK_D], -1, tl.int32)
        n_new = tl.full([], 0, tl.int32)
        popped = tl.full([], 0, tl.int32)
        go = (n_preempted == 0) & (m < S) & (budget > 0) & (tl.sum(waiting.to(tl.int32), 0) > 0)
        while go:
            w_pri = tl.min(tl.where(waiting, pri_d, _INT32_MAX), 0)
            w_cand = waiting & (pri_d == w_pri)
            w_arr = tl.min(tl.where(w_cand, arr_d, _INT64_MAX), 0)
            w_slot = tl.min(tl.where(w_cand & (arr_d == w_arr), offs_d, BLOCK_D), 0)
            w_is = offs_d == w_slot
            w_rem = tl.sum(tl.where(w_is, ntok_d, 0), 0)  # all its tokens: a waiting slot has none computed
            w_n = tl.minimum(w_rem, budget)
            w_need = (w_n + BS - 1) // BS
            w_fits = w_need <= top - popped
            w_take = w_is & w_fits
            w_samples = w_fits & (w_n == w_rem)
            adm_rank = tl.where(w_take, n_new, adm_rank)
            adm_n = tl.where(w_take, w_n, adm_n)
            adm_need = tl.where(w_take, w_need, adm_need)
            adm_off = tl.where(w_take, popped, adm_off)
            adm_qs = tl.where(w_take, ntot, adm_qs)
            adm_row = tl.where(w_take & w_samples, nsamp, adm_row)
            f = w_fits.to(tl.int32)
            popped += w_need * f
            budget -= w_n * f
            ntot += w_n * f
            nsamp += w_samples.to(tl.int32)
            n_new += f
            waiting = waiting & ~w_take
            go = w_fits & (m + n_new < S) & (budget > 0) & (tl.sum(waiting.to(tl.int32), 0) > 0)
        adm = adm_rank >= 0
        _pop_blocks(adm, adm_need, adm_off, offs_d, tl.zeros([BLOCK_D], tl.int32), top,
                    block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J)  # fmt: skip
        top -= popped
        tl.store(slot_state_ptr + offs_d, tl.full([BLOCK_D], _RUNNING, tl.int32), mask=adm)
        tl.store(run_order_ptr + offs_d, next_run_order + adm_rank, mask=adm)
        tl.store(num_computed_ptr + offs_d, adm_n, mask=adm)
        tl.store(num_blocks_ptr + offs_d, adm_need, mask=adm)
        next_run_order += n_new
        bi_d = nseq + adm_rank
        tl.store(step_slot_ptr + bi_d, offs_d, mask=adm)
        tl.store(step_chunk_ptr + bi_d, adm_n, mask=adm)
        tl.store(query_start_ptr + bi_d, adm_qs, mask=adm)
        tl.store(context_lens_ptr + bi_d, adm_n, mask=adm)
        nseq += n_new
        any_random = tl.maximum(any_random, _write_sample_rows(
            adm_row >= 0, adm_row, offs_d, (adm_qs + adm_n - 1).to(tl.int64), sample_slot_ptr, sample_rows_ptr,
            temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, num_tokens_ptr, prompt_len_ptr,
            row_temperature_ptr, row_top_k_ptr, row_top_p_ptr, row_min_p_ptr, row_seed_ptr, row_output_index_ptr,
        ))  # fmt: skip

    # 5. The rest of the step tables (unused sequences and sample rows), the SWITCH values.
    unused_s = (offs_s >= nseq) & (offs_s < S)
    tl.store(step_slot_ptr + offs_s, tl.full([BLOCK_S], -1, tl.int32), mask=unused_s)
    tl.store(step_chunk_ptr + offs_s, tl.zeros([BLOCK_S], tl.int32), mask=unused_s)
    tl.store(context_lens_ptr + offs_s, tl.zeros([BLOCK_S], tl.int32), mask=unused_s)
    offs_s1 = tl.arange(0, BLOCK_S1)
    tl.store(
        query_start_ptr + offs_s1,
        tl.zeros([BLOCK_S1], tl.int32) + ntot,
        mask=(offs_s1 >= nseq) & (offs_s1 <= S),
    )
    unused_r = (offs_s >= nsamp) & (offs_s < S)
    tl.store(sample_slot_ptr + offs_s, tl.full([BLOCK_S], -1, tl.int32), mask=unused_r)
    tl.store(sample_rows_ptr + offs_s, tl.full([BLOCK_S], -1, tl.int64), mask=unused_r)
    tl.store(row_temperature_ptr + offs_s, tl.zeros([BLOCK_S], tl.float32), mask=unused_r)
    tl.store(row_top_k_ptr + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    tl.store(row_top_p_ptr + offs_s, tl.full([BLOCK_S], 1.0, tl.float32), mask=unused_r)
    tl.store(row_min_p_ptr + offs_s, tl.zeros([BLOCK_S], tl.float32), mask=unused_r)
    tl.store(row_seed_ptr + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    tl.store(row_output_index_ptr + offs_s, tl.zeros([BLOCK_S], tl.int64), mask=unused_r)
    offs_b = tl.arange(0, BLOCK_NB)
    buckets = tl.load(buckets_ptr + offs_b, mask=offs_b < NUM_BUCKETS, other=_INT32_MAX)
    bucket_index = tl.where(ntot > 0, tl.sum((buckets < ntot).to(tl.int32), 0), NUM_BUCKETS)
    bucket = tl.sum(tl.where(offs_b == bucket_index, buckets, 0), 0)
    tl.store(step_num_tokens_ptr, ntot)
    tl.store(bucket_index_ptr, bucket_index)
    tl.store(sampler_index_ptr, any_random)

    # 6. The forward's token rows (bucket padding included) and block tables.
    tl.debug_barrier()  # step tables, block tables and prompt copies above are visible to every thread
    if ntot > 0:
        q_end = tl.load(query_start_ptr + 1 + offs_s, mask=offs_s < nseq, other=_INT32_MAX)
        for t0 in range(0, bucket, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            in_step = t < ntot
            b = tl.sum((q_end[None, :] <= t[:, None]).to(tl.int32), 1)
            slot = tl.load(step_slot_ptr + b, mask=in_step, other=0)
            q0 = tl.load(query_start_ptr + b, mask=in_step, other=0)
            start = tl.load(context_lens_ptr + b, mask=in_step, other=0) - tl.load(
                step_chunk_ptr + b, mask=in_step, other=0
            )
            pos = start + t - q0
            tok = tl.load(token_ids_ptr + slot * MAX_MODEL_LEN + pos, mask=in_step, other=0)
            block = tl.load(block_table_ptr + slot * MAXB + pos // BS, mask=in_step, other=0)
            in_bucket = t < bucket
            tl.store(input_ids_ptr + t, tl.where(in_step, tok, 0).to(tl.int64), mask=in_bucket)
            tl.store(positions_ptr + t, tl.where(in_step, pos, 0).to(tl.int64), mask=in_bucket)
            mapping = tl.where(in_step, block.to(tl.int64) * BS + pos % BS, -1)
            tl.store(slot_mapping_ptr + t, mapping, mask=in_bucket)
        # Block tables: the batch's rows, -1 elsewhere. Only the columns that can hold a block id now
        # or did after the last forward step are written (scratch keeps that width; every column
        # beyond it is -1 already), so the cost follows the longest context, not max_model_len.
        in_batch = offs_s < nseq
        rows = tl.load(step_slot_ptr + offs_s, mask=in_batch, other=0)
        width = tl.max(tl.load(num_blocks_ptr + rows, mask=in_batch, other=0), 0)
        columns = tl.maximum(width, table_width)
        for c0 in range(0, columns, BLOCK_C):
            col = c0 + tl.arange(0, BLOCK_C)
            cm = col[None, :] < columns
            table = tl.load(
                block_table_ptr + rows[:, None] * MAXB + col[None, :], mask=in_batch[:, None] & cm, other=-1
            )
            tl.store(
                block_tables_ptr + offs_s[:, None] * MAXB + col[None, :],
                table,
                mask=(offs_s < S)[:, None] & cm,
            )
        table_width = width

    # 7. Counters, active slots.
    offs_c = tl.arange(0, BLOCK_NC)
    steps = (ntot > 0).to(tl.int64)
    delta = (
        tl.where(offs_c == _C_LOOP, 1, 0)
        + tl.where(offs_c == _C_STEPS, steps, 0)
        + tl.where(offs_c == _C_STEP_TOKENS, ntot.to(tl.int64), 0)
        + tl.where(offs_c == _C_PREEMPT, n_preempted.to(tl.int64), 0)
        + tl.where(offs_c == _C_ADMITTED, n_admitted.to(tl.int64), 0)
        + tl.where(offs_c == _C_REJECTED, n_rejected.to(tl.int64), 0)
        + tl.where(offs_c == _C_CANCELLED, n_cancelled.to(tl.int64), 0)
        + tl.where(offs_c == _C_UNADDRESSABLE, n_unaddressable.to(tl.int64), 0)
    )
    counters = tl.load(counters_ptr + offs_c, mask=offs_c < NUM_COUNTERS, other=0)
    num_active = tl.sum((md & (st != _FREE)).to(tl.int32), 0)
    tl.debug_barrier()  # every warp has read the words below before one thread writes them
    tl.store(counters_ptr + offs_c, counters + delta, mask=offs_c < NUM_COUNTERS)
    tl.store(num_active_ptr, num_active)
    tl.store(free_top_ptr, top)
    tl.store(next_arrival_ptr, next_arrival)
    tl.store(next_run_order_ptr, next_run_order)
    tl.store(scratch_ptr + BLOCK_D + BLOCK_S, table_width)


@triton.jit
def _write_sample_rows(
    samples, row, slot, logits_row, sample_slot_ptr, sample_rows_ptr,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, num_tokens_ptr, prompt_len_ptr,
    row_temperature_ptr, row_top_k_ptr, row_top_p_ptr, row_min_p_ptr, row_seed_ptr, row_output_index_ptr,
):  # fmt: skip
    """Sample row `row` of each sampling sequence: which slot, which token row of the step, and the
    slot's sampling parameters gathered so the sampler reads rows directly. Returns 1 if any row
    samples at a temperature > 0."""
    temperature = tl.load(temperature_ptr + slot, mask=samples, other=0.0)
    tl.store(sample_slot_ptr + row, slot, mask=samples)
    tl.store(sample_rows_ptr + row, logits_row, mask=samples)
    tl.store(row_temperature_ptr + row, temperature, mask=samples)
    tl.store(row_top_k_ptr + row, tl.load(top_k_ptr + slot, mask=samples, other=0).to(tl.int64), mask=samples)
    tl.store(row_top_p_ptr + row, tl.load(top_p_ptr + slot, mask=samples, other=1.0), mask=samples)
    tl.store(row_min_p_ptr + row, tl.load(min_p_ptr + slot, mask=samples, other=0.0), mask=samples)
    tl.store(row_seed_ptr + row, tl.load(seed_ptr + slot, mask=samples, other=0), mask=samples)
    generated = tl.load(num_tokens_ptr + slot, mask=samples, other=0) - tl.load(
        prompt_len_ptr + slot, mask=samples, other=0
    )
    tl.store(row_output_index_ptr + row, generated.to(tl.int64), mask=samples)
    return (tl.sum((samples & (temperature > 0.0)).to(tl.int32), 0) > 0).to(tl.int32)
