"""The GPU loop's schedule step as one Triton program: ring intake, cancels, batch, forward inputs.

One launch (grid (1,)) does what the CPU side does between two model steps (docs/device_loop.md,
"schedule"): honour the ring's shutdown word, apply client cancels, admit request records from the
ring into free sequence slots (validated exactly like engine_server._decode), pick the step's chunks
the way the reference Scheduler.schedule does (decodes first, prefill chunks in the rest of the token
budget, KV blocks from the device free stack, recompute preemption, then admission of waiting slots
in (priority, arrival) order), and write the forward's StepInputs, the step tables and the per-row
sampling tensors. Everything the host would compute is computed here from device state, so the
launch can sit in a CUDA graph with no host in the loop.

`schedule_kernel` is the program's steps in order; each step is a helper (Triton inlines them, so
the program is the same as one function): ring intake in schedule_records.py, the KV blocks and the
prefix cache in prefix_cache.py, the batch in schedule_batch.py, the outputs in schedule_step.py. A
step that repeats the last one's batch, every sequence decoding, takes the short path of
schedule_steady.py instead of the batch and the outputs. Every code and
offset it shares with the rest of the project arrives as a constexpr (kernels/loop_codes.py).

How it is laid out for speed: per-slot state lives in registers as [BLOCK_D] vectors; running
sequences are put in run order once (compaction + a rank over the running ones, through a small scratch buffer) and
the budget fill is done in vectorized rounds (prefix sums), one round per preemption event, so a step
without preemption is one round. The sequential parts (records of one launch, admissions of waiting
slots) loop over registers with masked reductions; global memory is only touched to gather/scatter.

Ring access (the region is host memory mapped into the GPU, written by another process): every read
is a volatile load; a record's `seq` word is read with acquire semantics before the record; the
consumer words `req_tail` / `arena_tail` are written with release semantics after a CTA barrier, so
every thread's reads of the records and prompts are done before the front end may reuse their space
(docs/protocol.md, "Publication order"). With ON_GPU these are `ld.acquire.sys` / `st.release.sys`
in inline PTX (kernels/ring_access.py); without (Triton's CPU interpreter, where there is no
reordering) plain loads/stores.

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

from typing import NamedTuple

import triton
import triton.language as tl
from blink_appliance.kernels.prefix_cache import BlockTensors, close_lru, open_lru, release_lanes
from blink_appliance.kernels.ring_access import now_ns, phase_stamp
from blink_appliance.kernels.schedule_batch import build_batch
from blink_appliance.kernels.schedule_records import read_ring_words, take_records
from blink_appliance.kernels.schedule_steady import decode_again, steady_decodes
from blink_appliance.kernels.schedule_step import counter_deltas, finish_step_tables, write_forward_inputs


class SlotTensors(NamedTuple):
    """DeviceState's per-slot tensors (engine/loop/state.py says what each holds)."""

    slot_state: tl.tensor
    chan: tl.tensor
    generation: tl.tensor
    request_id: tl.tensor
    priority: tl.tensor
    arrival: tl.tensor
    run_order: tl.tensor
    run_priority: tl.tensor
    wait_since: tl.tensor
    prompt_len: tl.tensor
    num_tokens: tl.tensor
    num_computed: tl.tensor
    max_tokens: tl.tensor
    temperature: tl.tensor
    top_p: tl.tensor
    top_k: tl.tensor
    min_p: tl.tensor
    seed: tl.tensor
    ignore_eos: tl.tensor
    n_stop: tl.tensor
    stop_ids: tl.tensor
    token_ids: tl.tensor
    block_table: tl.tensor
    num_blocks: tl.tensor
    finish_reason: tl.tensor
    error_code: tl.tensor
    lp_top_n: tl.tensor
    lp_offset: tl.tensor
    lp_next: tl.tensor
    c_offset: tl.tensor
    c_state: tl.tensor
    constraint_arena: tl.tensor
    penalized: tl.tensor
    presence_penalty: tl.tensor
    frequency_penalty: tl.tensor
    repetition_penalty: tl.tensor
    n_bias: tl.tensor
    bias_ids: tl.tensor
    bias_values: tl.tensor
    bias_stage_ids: tl.tensor  # the scheduler's scratch: each record's logit_bias on its way to its slot
    bias_stage_values: tl.tensor
    n_hashes: tl.tensor
    prefix_hash: tl.tensor


class StepTensors(NamedTuple):
    """What a step hands on: DeviceState's step tables and sample rows, GpuForward's StepInputs."""

    step_slot: tl.tensor
    step_chunk: tl.tensor
    sample_slot: tl.tensor
    row_temperature: tl.tensor
    row_top_k: tl.tensor
    row_top_p: tl.tensor
    row_min_p: tl.tensor
    row_seed: tl.tensor
    row_output_index: tl.tensor
    num_score_rows: tl.tensor
    score_slot: tl.tensor
    score_token: tl.tensor
    score_index: tl.tensor
    score_temperature: tl.tensor
    input_ids: tl.tensor
    positions: tl.tensor
    slot_mapping: tl.tensor
    query_start: tl.tensor
    context_lens: tl.tensor
    block_tables: tl.tensor
    sample_rows: tl.tensor
    score_rows: tl.tensor


@triton.jit
def schedule_kernel(  # long: the parameter list is the kernel's ABI (45 lines); the body is the steps in order
    ring_ptr,
    # DeviceState, per slot
    slot_state_ptr, chan_ptr, generation_ptr, request_id_ptr, priority_ptr, arrival_ptr, run_order_ptr,
    run_priority_ptr, wait_since_ptr, prompt_len_ptr, num_tokens_ptr, num_computed_ptr, max_tokens_ptr, temperature_ptr, top_p_ptr,
    top_k_ptr, min_p_ptr, seed_ptr, ignore_eos_ptr, n_stop_ptr, stop_ids_ptr, token_ids_ptr,
    block_table_ptr, num_blocks_ptr, finish_reason_ptr, error_code_ptr, lp_top_n_ptr, lp_offset_ptr,
    lp_next_ptr, c_offset_ptr, c_state_ptr, constraint_arena_ptr, penalized_ptr, presence_penalty_ptr, frequency_penalty_ptr, repetition_penalty_ptr, n_bias_ptr,
    bias_ids_ptr, bias_values_ptr,
    # DeviceState, KV blocks (kernels/prefix_cache.py), step tables, sampling rows, control
    free_blocks_ptr, free_top_ptr, block_ref_ptr, block_cached_ptr, block_key_ptr, cache_table_ptr, lru_ptr,
    lru_pos_ptr, lru_words_ptr, evicted_ptr, n_hashes_ptr, prefix_hash_ptr, step_slot_ptr, step_chunk_ptr, sample_slot_ptr, step_num_tokens_ptr,
    bucket_index_ptr, sampler_index_ptr, num_sample_rows_ptr, row_temperature_ptr, row_top_k_ptr, row_top_p_ptr, row_min_p_ptr,
    row_seed_ptr, row_output_index_ptr, num_score_rows_ptr, score_slot_ptr, score_token_ptr, score_index_ptr,
    score_temperature_ptr, num_active_ptr, shutdown_seen_ptr, next_arrival_ptr, next_run_order_ptr, counters_ptr,
    # GpuForward.inputs (StepInputs)
    input_ids_ptr, positions_ptr, slot_mapping_ptr, query_start_ptr, context_lens_ptr, block_tables_ptr,
    sample_rows_ptr, score_rows_ptr,
    # the scheduler's own: bucket sizes, scratch, seed for requests without one
    buckets_ptr, scratch_ptr, snap_ptr, engine_seed, bias_stage_ids_ptr, bias_stage_values_ptr,
    # the step's start time: %globaltimer + clock_offset_ns on the GPU, else the host clock (interpreter)
    step_start_ns_ptr, clock_offset_ns_ptr, host_clock_ns_ptr,
    # bench/loop_profile.py --schedule-phases: a cycle stamp after each phase (STAMPS; GPU only)
    stamps_ptr, STAMPS: tl.constexpr,
    # loop geometry
    D: tl.constexpr, S: tl.constexpr, MAX_BATCHED: tl.constexpr, NUM_BUCKETS: tl.constexpr,
    BS: tl.constexpr, MAXB: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, VOCAB: tl.constexpr, NUM_COUNTERS: tl.constexpr,
    AGING: tl.constexpr, LIMIT: tl.constexpr, SCORE: tl.constexpr, BE_BATCH: tl.constexpr, BE_PRI: tl.constexpr,
    # ring geometry and section offsets
    REQ_SLOTS: tl.constexpr, ARENA_TOKENS: tl.constexpr, MAX_PROMPT: tl.constexpr,
    MAX_INFLIGHT: tl.constexpr, MAX_OUTPUT: tl.constexpr, MAX_STOP: tl.constexpr, AREAS: tl.constexpr,
    MAX_BIAS: tl.constexpr, BIAS_TILE: tl.constexpr,
    # the prefix cache: the ring's hash block size (0: off), table entries, LRU ring, per-slot hash words
    PBS: tl.constexpr, C: tl.constexpr, Q: tl.constexpr, HSTRIDE: tl.constexpr, BLOCK_L: tl.constexpr,
    OFF_RECORDS: tl.constexpr, REC_BYTES: tl.constexpr, OFF_ARENA: tl.constexpr, OFF_CTL: tl.constexpr,
    OFF_PROG: tl.constexpr,
    # tile sizes
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_S1: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_STOP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_NC: tl.constexpr, BLOCK_RANK: tl.constexpr,
    BLOCK_HASH: tl.constexpr, BLOCK_SCORE: tl.constexpr, ON_GPU: tl.constexpr,  # ON_GPU: inline PTX on the ring and the clock
    STEADY: tl.constexpr,  # the steady decode step (kernels/schedule_steady.py); off only to test it against the full one
    # codes and offsets the launcher fills by name (kernels/loop_codes.py)
    SLOT: tl.constexpr, FINISH: tl.constexpr, ERROR: tl.constexpr, COUNTER: tl.constexpr,
    CONTROL: tl.constexpr, RECORD: tl.constexpr, CHANNEL: tl.constexpr,
):  # fmt: skip
    slots = SlotTensors(  # positionally, in the order of its fields
        slot_state_ptr, chan_ptr, generation_ptr, request_id_ptr, priority_ptr, arrival_ptr, run_order_ptr,
        run_priority_ptr, wait_since_ptr, prompt_len_ptr, num_tokens_ptr, num_computed_ptr, max_tokens_ptr,
        temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, ignore_eos_ptr, n_stop_ptr,
        stop_ids_ptr, token_ids_ptr, block_table_ptr, num_blocks_ptr, finish_reason_ptr, error_code_ptr,
        lp_top_n_ptr, lp_offset_ptr, lp_next_ptr, c_offset_ptr, c_state_ptr, constraint_arena_ptr, penalized_ptr, presence_penalty_ptr, frequency_penalty_ptr,
        repetition_penalty_ptr, n_bias_ptr, bias_ids_ptr, bias_values_ptr, bias_stage_ids_ptr,
        bias_stage_values_ptr, n_hashes_ptr, prefix_hash_ptr,
    )  # fmt: skip
    blocks = BlockTensors(block_ref_ptr, block_cached_ptr, block_key_ptr, cache_table_ptr, lru_ptr, lru_pos_ptr,
                          evicted_ptr)  # fmt: skip
    step = StepTensors(  # positionally, in the order of its fields
        step_slot_ptr, step_chunk_ptr, sample_slot_ptr, row_temperature_ptr, row_top_k_ptr, row_top_p_ptr,
        row_min_p_ptr, row_seed_ptr, row_output_index_ptr, num_score_rows_ptr, score_slot_ptr, score_token_ptr,
        score_index_ptr, score_temperature_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, query_start_ptr,
        context_lens_ptr, block_tables_ptr, sample_rows_ptr, score_rows_ptr,
    )  # fmt: skip
    phase_stamp(stamps_ptr, 0, STAMPS)
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    st = tl.load(slot_state_ptr + offs_d, mask=md, other=SLOT.FREE)
    nb_d = tl.load(num_blocks_ptr + offs_d, mask=md, other=0)
    ch_d = tl.load(chan_ptr + offs_d, mask=md, other=-1)
    gen_d = tl.load(generation_ptr + offs_d, mask=md, other=0)
    # The step's start, for commit's step time (nothing here reads it back).
    tl.store(step_start_ns_ptr, now_ns(host_clock_ns_ptr, clock_offset_ns_ptr, ON_GPU))
    # Read here, written back once at the end (module docstring: one-element updates and warps).
    top = tl.load(free_top_ptr)
    next_arrival = tl.load(next_arrival_ptr)
    next_run_order = tl.load(next_run_order_ptr)
    clock = tl.load(counters_ptr + COUNTER.steps)  # steps before this one: aging's clock (read only here)
    table_width = tl.load(scratch_ptr + BLOCK_D + BLOCK_S)  # block-table columns the last forward used
    lru_head, lru_tail, n_cached = open_lru(lru_words_ptr, blocks, Q, BLOCK_L)
    shutdown, tail, arena_tail, live, addressable, cancel_word, position, rec, seq_word = read_ring_words(
        ring_ptr, snap_ptr, st, ch_d, md, OFF_RECORDS, REC_BYTES, REQ_SLOTS, OFF_CTL, MAX_INFLIGHT,
        BLOCK_R, BLOCK_D, SLOT, CONTROL, CHANNEL, ON_GPU,
    )  # fmt: skip
    phase_stamp(stamps_ptr, 1, STAMPS)
    free_d, n_records = _records_to_take(st, md, position, seq_word, SLOT)
    cancelled = addressable & (cancel_word == gen_d)

    # What the step ends up with (the shutdown branch leaves them empty).
    nseq = tl.full([], 0, tl.int32)  # sequences in the batch
    ntot = tl.full([], 0, tl.int32)  # tokens in the step
    nsamp = tl.full([], 0, tl.int32)  # sample rows
    sampler_index = tl.full([], 0, tl.int32)
    n_preempted = tl.full([], 0, tl.int32)
    n_admitted = tl.full([], 0, tl.int32)
    n_rejected = tl.full([], 0, tl.int32)
    n_cancelled = tl.full([], 0, tl.int32)
    n_unaddressable = tl.full([], 0, tl.int32)
    n_queried = tl.full([], 0, tl.int32)  # prefix cache: tokens of the admissions that looked up
    n_hit = tl.full([], 0, tl.int32)  # and of those, found cached

    # 0. The last step's batch decoding again (kernels/schedule_steady.py), the common serving step.
    table_rows = tl.load(scratch_ptr + BLOCK_D + BLOCK_S + 1)  # the last forward step's sequences
    no_ring_work = (shutdown == 0) & (tl.sum(cancelled.to(tl.int32), 0) == 0) & (n_records == 0)
    steady, ms, ks, ntok_k, ncomp_k, nb_k, plen_k, need_k = steady_decodes(
        no_ring_work, st, md, top, n_cached, table_width, table_rows, step_num_tokens_ptr, offs_s, slots, step,
        BS, PBS, STEADY, SLOT,
    )  # fmt: skip
    # Through memory, so the branch does not depend on the loads above in the IR: Triton's coalescing
    # pass walks each memory op's slice, and with them in it the kernel compiled 40% slower.
    tl.store(scratch_ptr + BLOCK_D + BLOCK_S + 2, steady.to(tl.int32))
    tl.debug_barrier()
    steady = tl.load(scratch_ptr + BLOCK_D + BLOCK_S + 2) != 0
    if steady:
        top, lru_head, n_cached, table_width = decode_again(
            ms, ks, ntok_k, ncomp_k, nb_k, plen_k, need_k, top, lru_head, lru_tail, n_cached, clock, offs_s,
            free_blocks_ptr, slots, blocks, step, BS, MAXB, MAX_MODEL_LEN, BLOCK_J, C, Q, BLOCK_L, SLOT,
        )  # fmt: skip
        nseq, ntot = table_rows, table_rows
        for i in tl.static_range(2, 12):
            phase_stamp(stamps_ptr, i, STAMPS)  # the whole steady step shows as "cancels"
    elif shutdown != 0:
        # 1. Shutdown: every live slot ends with ABORT / SHUTDOWN; nothing is admitted or scheduled.
        # Records still in the ring stay there for the host to drain once the loop has ended.
        top, lru_tail, n_cached = _end_slots(live, nb_d, top, lru_tail, n_cached, ERROR.SHUTDOWN, free_blocks_ptr, slots,
                                         blocks, MAXB, BLOCK_D, BLOCK_J, Q, SLOT, FINISH)  # fmt: skip
        tl.store(shutdown_seen_ptr, 1)
    else:
        # 2. Cancels: a live slot whose channel's cancel word equals its generation.
        st, top, lru_tail, n_cached, n_cancelled = _apply_cancels(
            st, top, lru_tail, n_cached, cancelled, nb_d, free_blocks_ptr, slots, blocks,
            MAXB, BLOCK_D, BLOCK_J, Q, SLOT, FINISH,
        )  # fmt: skip
        phase_stamp(stamps_ptr, 2, STAMPS)

        # 3. Records from the ring: the published run starting at req_tail, at most one per free slot.
        n_admitted, n_rejected, n_cancelled, n_unaddressable, next_arrival, st = _take_published(
            st, ch_d, md, free_d, n_records, tail, arena_tail, rec, next_arrival, n_cancelled, clock, engine_seed,
            ring_ptr, snap_ptr, slots, OFF_CTL, OFF_PROG, OFF_ARENA, ARENA_TOKENS, MAX_PROMPT, MAX_INFLIGHT,
            MAX_OUTPUT, MAX_STOP, AREAS, MAX_BIAS, BIAS_TILE, PBS, HSTRIDE, MAX_MODEL_LEN, VOCAB, BLOCK_D,
            BLOCK_R, BLOCK_STOP, BLOCK_P, SLOT, FINISH, ERROR, CONTROL, RECORD, CHANNEL, ON_GPU,
        )  # fmt: skip
        phase_stamp(stamps_ptr, 3, STAMPS)

        # 4. The batch: the class cap (LIMIT) and best-effort turns (BE_BATCH) hold some running ones; the
        # others in (class, admission) order get their chunks (preempting the last ones when blocks run
        # out), then waiting slots are admitted, preempting running ones of a lower class to fit.
        top, lru_head, lru_tail, n_cached, next_run_order, nseq, ntot, nsamp, sampler_index, n_preempted, n_queried, n_hit = (
            build_batch(
                st, md, top, lru_head, lru_tail, n_cached, next_run_order, clock, offs_s, scratch_ptr, free_blocks_ptr,
                slots, blocks, step, S, MAX_BATCHED, BS, MAXB, BLOCK_D, BLOCK_S, BLOCK_J, BLOCK_RANK, AGING,
                LIMIT, SCORE, PBS, C, Q, HSTRIDE, BLOCK_L, BLOCK_HASH, BLOCK_SCORE, MAX_MODEL_LEN, SLOT, BE_BATCH,
                BE_PRI, stamps_ptr, STAMPS,
            )
        )  # fmt: skip

    if steady.to(tl.int32) == 0:
        # 5 and 6. The rest of the step tables and the SWITCH values, then the forward's inputs.
        table_width = _step_outputs(
            nseq, ntot, nsamp, sampler_index, table_width, table_rows, offs_s, slots, step, buckets_ptr,
            step_num_tokens_ptr, bucket_index_ptr, sampler_index_ptr, num_sample_rows_ptr, stamps_ptr,
            S, NUM_BUCKETS, BS, MAXB, MAX_MODEL_LEN, BLOCK_S, BLOCK_S1, BLOCK_NB, BLOCK_T, BLOCK_C, BLOCK_ROWS,
            STAMPS,
        )  # fmt: skip

    # 7. Counters, active slots, and the words read at the start written back.
    delta = counter_deltas(ntot, n_preempted, n_admitted, n_rejected, n_cancelled, n_unaddressable, n_queried,
                           n_hit, steady, BLOCK_NC, COUNTER)  # fmt: skip
    _add_counters(delta, st, md, counters_ptr, num_active_ptr, NUM_COUNTERS, BLOCK_NC, SLOT)
    _store_words(top, lru_head, lru_tail, n_cached, next_arrival, next_run_order, table_width, nseq, ntot,
                 free_top_ptr, lru_words_ptr, next_arrival_ptr, next_run_order_ptr, scratch_ptr + BLOCK_D + BLOCK_S)  # fmt: skip
    phase_stamp(stamps_ptr, 12, STAMPS)


@triton.jit
def _step_outputs(
    nseq, ntot, nsamp, sampler_index, table_width, table_rows, offs_s, slots, step, buckets_ptr,
    step_num_tokens_ptr, bucket_index_ptr, sampler_index_ptr, num_sample_rows_ptr, stamps_ptr,
    S: tl.constexpr, NUM_BUCKETS: tl.constexpr, BS: tl.constexpr, MAXB: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_S1: tl.constexpr, BLOCK_NB: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_ROWS: tl.constexpr, STAMPS: tl.constexpr,
):  # fmt: skip
    """A full step's outputs once its batch is known: the rest of the step tables (unused sequences
    and sample rows) and the SWITCH values, then the forward's token rows (bucket padding included)
    and block tables. Returns the block-table width the rows need now."""
    bucket = finish_step_tables(
        nseq, ntot, nsamp, sampler_index, offs_s, step, buckets_ptr, step_num_tokens_ptr, bucket_index_ptr,
        sampler_index_ptr, num_sample_rows_ptr, S, NUM_BUCKETS, BLOCK_S, BLOCK_S1, BLOCK_NB,
    )  # fmt: skip
    phase_stamp(stamps_ptr, 10, STAMPS)
    tl.debug_barrier()  # step tables, block tables and prompt copies above are visible to every thread
    if ntot > 0:
        table_width = write_forward_inputs(
            nseq, ntot, bucket, table_width, table_rows, offs_s, slots, step,
            S, BS, MAXB, MAX_MODEL_LEN, BLOCK_S, BLOCK_T, BLOCK_C, BLOCK_ROWS,
        )  # fmt: skip
    phase_stamp(stamps_ptr, 11, STAMPS)
    return table_width


@triton.jit
def _store_words(top, lru_head, lru_tail, n_cached, next_arrival, next_run_order, table_width, nseq, ntot,
                 free_top_ptr, lru_words_ptr, next_arrival_ptr, next_run_order_ptr, table_ptr):  # fmt: skip
    """The one-element words the step read at its start, written back once, after _add_counters'
    barrier (module docstring: one-element updates and warps); table_ptr: the block-table columns and
    rows the forward step wrote (the rows only when it ran)."""
    tl.store(free_top_ptr, top)
    close_lru(lru_words_ptr, lru_head, lru_tail, n_cached)
    tl.store(next_arrival_ptr, next_arrival)
    tl.store(next_run_order_ptr, next_run_order)
    tl.store(table_ptr, table_width)
    if ntot > 0:
        tl.store(table_ptr + 1, nseq)


@triton.jit
def _take_published(
    st, ch_d, md, free_d, n_records, tail, arena_tail, rec, next_arrival, n_cancelled, clock, engine_seed,
    ring_ptr, snap_ptr, slots,
    OFF_CTL: tl.constexpr, OFF_PROG: tl.constexpr, OFF_ARENA: tl.constexpr, ARENA_TOKENS: tl.constexpr,
    MAX_PROMPT: tl.constexpr, MAX_INFLIGHT: tl.constexpr, MAX_OUTPUT: tl.constexpr, MAX_STOP: tl.constexpr,
    AREAS: tl.constexpr, MAX_BIAS: tl.constexpr, BIAS_TILE: tl.constexpr, PBS: tl.constexpr,
    HSTRIDE: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, VOCAB: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_STOP: tl.constexpr, BLOCK_P: tl.constexpr, SLOT: tl.constexpr,
    FINISH: tl.constexpr, ERROR: tl.constexpr, CONTROL: tl.constexpr, RECORD: tl.constexpr,
    CHANNEL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The first n_records published records at req_tail taken (take_records) into free slots
    (free_d); a slot taken now waits from this step on (aging). Returns (admitted, rejected,
    n_cancelled, unaddressable, next_arrival, the slot states)."""
    n_admitted = tl.full([], 0, tl.int32)
    n_rejected = tl.full([], 0, tl.int32)
    n_unaddressable = tl.full([], 0, tl.int32)
    if n_records > 0:
        n_admitted, n_rejected, n_cancelled, n_unaddressable, next_arrival, st = take_records(
            st, ch_d, free_d, md, tail, arena_tail, rec, n_records, next_arrival, n_cancelled,
            engine_seed, ring_ptr, snap_ptr, slots,
            OFF_CTL, OFF_PROG, OFF_ARENA, ARENA_TOKENS, MAX_PROMPT, MAX_INFLIGHT, MAX_OUTPUT, MAX_STOP, AREAS,
            MAX_BIAS, BIAS_TILE, PBS, HSTRIDE,
            MAX_MODEL_LEN, VOCAB, BLOCK_D, BLOCK_R, BLOCK_STOP, BLOCK_P,
            SLOT, FINISH, ERROR, CONTROL, RECORD, CHANNEL, ON_GPU,
        )  # fmt: skip
        offs_d = tl.arange(0, BLOCK_D)
        taken = free_d & (st == SLOT.WAITING)
        tl.store(slots.wait_since + offs_d, tl.zeros([BLOCK_D], tl.int64) + clock, mask=taken)
    return n_admitted, n_rejected, n_cancelled, n_unaddressable, next_arrival, st


@triton.jit
def _records_to_take(st, md, position, seq_word, SLOT: tl.constexpr):
    """The free slots, and how many records this step takes: the published run at req_tail (record n
    is published when its seq word is n + 1), at most one per free slot."""
    unpublished = (seq_word != position + 1).to(tl.int32)
    published = tl.sum((tl.cumsum(unpublished, 0) == 0).to(tl.int32), 0)
    free_d = md & (st == SLOT.FREE)
    return free_d, tl.minimum(published, tl.sum(free_d.to(tl.int32), 0))


@triton.jit
def _add_counters(delta, st, md, counters_ptr, num_active_ptr, NUM_COUNTERS: tl.constexpr,
                  BLOCK_NC: tl.constexpr, SLOT: tl.constexpr):  # fmt: skip
    """Add this iteration's deltas to the counters and store the active slot count, after a barrier:
    every warp has read the words the caller stores next."""
    offs_c = tl.arange(0, BLOCK_NC)
    counters = tl.load(counters_ptr + offs_c, mask=offs_c < NUM_COUNTERS, other=0)
    num_active = tl.sum((md & (st != SLOT.FREE)).to(tl.int32), 0)
    tl.debug_barrier()
    tl.store(counters_ptr + offs_c, counters + delta, mask=offs_c < NUM_COUNTERS)
    tl.store(num_active_ptr, num_active)


@triton.jit
def _apply_cancels(
    st, top, tail, n_cached, cancelled, nb_d, free_blocks_ptr, slots, blocks,
    MAXB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, Q: tl.constexpr,
    SLOT: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """End the live slots whose channel's cancel word (snapped) equals their generation (`cancelled`)
    with ABORT. Returns (the slot states now, the stack top, the LRU tail and live count, how many
    were cancelled)."""
    n_cancelled = tl.sum(cancelled.to(tl.int32), 0)
    if n_cancelled > 0:
        top, tail, n_cached = _end_slots(
            cancelled, nb_d, top, tail, n_cached, 0, free_blocks_ptr, slots, blocks, MAXB, BLOCK_D, BLOCK_J, Q,
            SLOT, FINISH,
        )  # fmt: skip
        st = tl.where(cancelled, SLOT.FINISHING, st)
    return st, top, tail, n_cached, n_cancelled


@triton.jit
def _end_slots(
    ending, nb_d, top, tail, n_cached, ERROR_CODE: tl.constexpr, free_blocks_ptr, slots, blocks,
    MAXB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, Q: tl.constexpr,
    SLOT: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """End the slots in `ending` (live ones) with ABORT and ERROR_CODE: their blocks let go of in slot
    order, FINISHING so that commit publishes the terminal event. Returns (top, tail, n_cached)."""
    offs_d = tl.arange(0, BLOCK_D)
    top, tail, n_cached = release_lanes(ending, offs_d, offs_d, nb_d, top, tail, n_cached, slots.block_table,
                                        free_blocks_ptr, blocks, MAXB, BLOCK_J, Q)  # fmt: skip
    tl.store(slots.slot_state + offs_d, tl.full([BLOCK_D], SLOT.FINISHING, tl.int32), mask=ending)
    tl.store(slots.finish_reason + offs_d, tl.full([BLOCK_D], FINISH.ABORT, tl.int32), mask=ending)
    tl.store(slots.error_code + offs_d, tl.full([BLOCK_D], ERROR_CODE, tl.int32), mask=ending)
    tl.store(slots.num_blocks + offs_d, tl.zeros([BLOCK_D], tl.int32), mask=ending)
    return top, tail, n_cached
