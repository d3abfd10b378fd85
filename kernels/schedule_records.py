"""Schedule's ring intake: the ring words a step reads, and request records admitted into slots.

Part of the schedule program (kernels/schedule.py, whose docstring gives the ring-access and
memory-ordering rules these helpers follow: volatile reads of the ring, the records' seq words
acquired, every word the front end may change made uniform through `snap`, req_tail / arena_tail
release-stored after a CTA barrier). Records are validated exactly like engine_server._decode and
LLMEngine.add_request, in their order; a rejected or cancelled record takes a slot as FINISHING so
that commit publishes its terminal event.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from blink_appliance.kernels.constraint import check_constraint, copy_constraints
from blink_appliance.kernels.ring_access import snap_ring_word, snap_seq_words, snap_tails, store_release

# Record outcomes inside the kernel besides "admitted" (0) and an ErrorCode (> 0).
_UNADDRESSABLE = tl.constexpr(-1)
_CANCELLED = tl.constexpr(1000)

# splitmix64 constants as int64 bit patterns (engine/reference/rng.py): the derived seed of a request
# without one.
_GAMMA = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = tl.constexpr(0x94D049BB133111EB - (1 << 64))
_INT64_MAX = tl.constexpr(2**63 - 1)


class RecordFields(NamedTuple):
    """The fields of the records a launch takes, one lane per record (unsigned ones zero-extended)."""

    request_id: tl.tensor
    generation: tl.tensor
    prompt_offset: tl.tensor
    arena_end: tl.tensor
    seed: tl.tensor
    chan: tl.tensor
    priority: tl.tensor
    prompt_len: tl.tensor
    max_tokens: tl.tensor
    temperature: tl.tensor
    top_p: tl.tensor
    min_p: tl.tensor
    top_k: tl.tensor
    has_seed: tl.tensor
    ignore_eos: tl.tensor
    n_stop: tl.tensor
    logprobs: tl.tensor  # 0: none; N + 1 for N alternatives
    prompt_logprobs: tl.tensor  # 1: prompt positions 1.. get logprob rows too
    lp_offset: tl.tensor
    constraint_len: tl.tensor  # words of its token automaton in the constraint area (0: none)
    constraint_offset: tl.tensor
    presence_penalty: tl.tensor
    frequency_penalty: tl.tensor
    repetition_penalty: tl.tensor  # 0 reads as 1 (off)
    n_bias: tl.tensor


@triton.jit
def read_ring_words(
    ring_ptr, snap_ptr, st, ch_d, md,
    OFF_RECORDS: tl.constexpr, REC_BYTES: tl.constexpr, REQ_SLOTS: tl.constexpr, OFF_CTL: tl.constexpr,
    MAX_INFLIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SLOT: tl.constexpr, CONTROL: tl.constexpr, CHANNEL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Every read of the ring a step needs, in one bus round trip (shutdown, cancel and seq words).
    Returns (shutdown, req_tail, arena_tail, live slots, slots with an addressable channel, their
    cancel words, the records' positions, byte offsets and seq words)."""
    ring_i64 = ring_ptr.to(tl.pointer_type(tl.int64))
    offs_d = tl.arange(0, BLOCK_D)
    live = md & ((st == SLOT.WAITING) | (st == SLOT.RUNNING))
    addressable = live & (ch_d >= 0) & (ch_d < MAX_INFLIGHT)
    tails = snap_tails(snap_ptr, BLOCK_R, BLOCK_D)  # no bus round trip before the seq words at req_tail
    tail = tl.load(tails)
    arena_tail = tl.load(tails + 1)
    cancel_word = tl.load(
        ring_i64 + (OFF_CTL + ch_d.to(tl.int64) * CHANNEL.ctl_bytes + CHANNEL.ctl_cancel) // 8,
        mask=addressable, other=0, volatile=True,
    )  # fmt: skip
    # Each word read by one thread, then one value for every thread through the snap (schedule.py): [0]
    # shutdown, [2, +BLOCK_R) seq words, [2 + BLOCK_R, +BLOCK_D) live slots' cancel words.
    snap_ring_word(ring_i64 + CONTROL.shutdown // 8, snap_ptr, ON_GPU)
    offs_r = tl.arange(0, BLOCK_R)
    position = tail + offs_r
    rec = OFF_RECORDS + (position % REQ_SLOTS) * REC_BYTES
    snap_seq_words(ring_i64 + OFF_RECORDS // 8, tail, snap_ptr + 2, BLOCK_R, REQ_SLOTS, REC_BYTES, ON_GPU)
    tl.store(snap_ptr + 2 + BLOCK_R + offs_d, cancel_word, mask=addressable)  # only live slots matter
    tl.debug_barrier()
    shutdown = tl.load(snap_ptr, volatile=True)
    seq_word = tl.load(snap_ptr + 2 + offs_r, volatile=True)
    cancel_word = tl.load(snap_ptr + 2 + BLOCK_R + offs_d, mask=addressable, other=0, volatile=True)
    return shutdown, tail, arena_tail, live, addressable, cancel_word, position, rec, seq_word


@triton.jit
def take_records(
    st, ch_d, free_d, md, tail, arena_tail, rec, n_records, next_arrival, n_cancelled, engine_seed,
    ring_ptr, snap_ptr, slots,
    OFF_CTL: tl.constexpr, OFF_PROG: tl.constexpr, OFF_ARENA: tl.constexpr, ARENA_TOKENS: tl.constexpr,
    MAX_PROMPT: tl.constexpr, MAX_INFLIGHT: tl.constexpr, MAX_OUTPUT: tl.constexpr, MAX_STOP: tl.constexpr,
    AREAS: tl.constexpr, MAX_BIAS: tl.constexpr, BIAS_TILE: tl.constexpr, PBS: tl.constexpr,
    HSTRIDE: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, VOCAB: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_STOP: tl.constexpr, BLOCK_P: tl.constexpr,
    SLOT: tl.constexpr, FINISH: tl.constexpr, ERROR: tl.constexpr, CONTROL: tl.constexpr,
    RECORD: tl.constexpr, CHANNEL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Take the first `n_records` records at req_tail (> 0; their seq words acquired) into free
    slots, then hand their ring and arena space back. Returns (records admitted, rejected,
    n_cancelled plus the cancelled ones, unaddressable, next_arrival after the admitted ones, the
    slot states now)."""
    tl.debug_barrier()  # every thread's reads below come after some thread's acquire of seq
    tk = tl.arange(0, BLOCK_R) < n_records
    recs = _load_records(ring_ptr, rec, tk, RECORD)
    ring_i64 = ring_ptr.to(tl.pointer_type(tl.int64))
    arena_head = tl.load(ring_i64 + CONTROL.arena_head // 8, volatile=True)
    on_chan = tk & (recs.chan < MAX_INFLIGHT)
    c_gen = tl.load(
        ring_i64 + (OFF_CTL + recs.chan * CHANNEL.ctl_bytes + CHANNEL.ctl_generation) // 8,
        mask=on_chan, other=0, volatile=True,
    )  # fmt: skip
    c_cancel = tl.load(
        ring_i64 + (OFF_CTL + recs.chan * CHANNEL.ctl_bytes + CHANNEL.ctl_cancel) // 8,
        mask=on_chan, other=0, volatile=True,
    )  # fmt: skip
    p_done = tl.load(
        ring_i64 + (OFF_PROG + recs.chan * CHANNEL.progress_bytes + CHANNEL.progress_done) // 8,
        mask=on_chan, other=0, volatile=True,
    )  # fmt: skip
    # The front end's words among these, made uniform (snap[1] arena_head, then per record
    # its channel's generation and cancel words after the first 2 + BLOCK_R + BLOCK_D).
    offs_r = tl.arange(0, BLOCK_R)
    at = 2 + BLOCK_R + BLOCK_D
    tl.store(snap_ptr + 1, arena_head)
    tl.store(snap_ptr + at + offs_r, c_gen)
    tl.store(snap_ptr + at + BLOCK_R + offs_r, c_cancel)
    tl.debug_barrier()
    arena_head = tl.load(snap_ptr + 1, volatile=True)
    c_gen = tl.load(snap_ptr + at + offs_r, volatile=True)
    c_cancel = tl.load(snap_ptr + at + BLOCK_R + offs_r, volatile=True)
    bias_bad = _stage_biases(
        ring_ptr, rec, tk, recs.n_bias, slots, VOCAB, MAX_BIAS, BIAS_TILE, BLOCK_R, RECORD
    )
    local, later, stop_m, stop_ids = _check_records(
        recs, tk, rec, arena_head, c_gen, c_cancel, p_done, ring_ptr, bias_bad,
        ARENA_TOKENS, MAX_PROMPT, MAX_INFLIGHT, MAX_OUTPUT, MAX_STOP, AREAS, MAX_MODEL_LEN, VOCAB, BLOCK_STOP,
        PBS, ERROR, RECORD,
    )  # fmt: skip
    r_slot, r_outcome, arena_tail = _place_records(
        ch_d, arena_tail, free_d, st, md, recs, local, later, arena_head, n_records, ring_ptr, slots,
        OFF_ARENA, ARENA_TOKENS, MAX_MODEL_LEN, VOCAB, PBS, HSTRIDE, BLOCK_D, BLOCK_R, BLOCK_P, SLOT, ERROR,
    )  # fmt: skip
    n_admitted, n_rejected, n_cancelled, n_unaddressable = _fill_record_slots(
        recs, tk, r_slot, r_outcome, stop_m, stop_ids, next_arrival, n_cancelled, engine_seed, slots,
        MAX_STOP, BLOCK_R, BLOCK_STOP, SLOT, FINISH,
    )  # fmt: skip
    tl.debug_barrier()  # the staged biases are every thread's to move
    _move_biases(r_slot, r_outcome, tk, recs.n_bias, slots, MAX_BIAS, BIAS_TILE, BLOCK_R)
    copy_constraints(r_slot, r_outcome, tk, recs, ring_ptr, slots, AREAS, BLOCK_R, BLOCK_P)
    next_arrival += n_admitted
    # All reads of the records and their prompts are done (barrier); then hand the space back.
    tl.debug_barrier()
    store_release(ring_i64 + CONTROL.req_tail // 8, tail + n_records, ON_GPU)
    store_release(ring_i64 + CONTROL.arena_tail // 8, arena_tail, ON_GPU)
    tails = snap_tails(snap_ptr, BLOCK_R, BLOCK_D)  # read by every warp before read_ring_words' barrier
    tl.store(tails, tail + n_records)
    tl.store(tails + 1, arena_tail)
    offs_d = tl.arange(0, BLOCK_D)
    st = tl.load(slots.slot_state + offs_d, mask=md, other=SLOT.FREE)
    return n_admitted, n_rejected, n_cancelled, n_unaddressable, next_arrival, st


@triton.jit
def _load_records(ring_ptr, rec, tk, RECORD: tl.constexpr):
    """The records' fields (offsets `rec`, lanes `tk`). Typed views of the region: every field is
    naturally aligned (the launcher checks it); offsets are in bytes, divided by the word size."""
    ring_i64 = ring_ptr.to(tl.pointer_type(tl.int64))
    ring_i32 = ring_ptr.to(tl.pointer_type(tl.int32))
    ring_u32 = ring_ptr.to(tl.pointer_type(tl.uint32))  # loaded zero-extended: a huge u32 stays huge
    ring_f64 = ring_ptr.to(tl.pointer_type(tl.float64))
    return RecordFields(
        request_id=tl.load(ring_i64 + (rec + RECORD.request_id) // 8, mask=tk, other=0, volatile=True),
        generation=tl.load(ring_i64 + (rec + RECORD.generation) // 8, mask=tk, other=0, volatile=True),
        prompt_offset=tl.load(ring_i64 + (rec + RECORD.prompt_offset) // 8, mask=tk, other=0, volatile=True),
        arena_end=tl.load(ring_i64 + (rec + RECORD.arena_end) // 8, mask=tk, other=0, volatile=True),
        seed=tl.load(ring_i64 + (rec + RECORD.seed) // 8, mask=tk, other=0, volatile=True),
        chan=tl.load(ring_u32 + (rec + RECORD.slot) // 4, volatile=True).to(tl.int64),
        priority=tl.load(ring_i32 + (rec + RECORD.priority) // 4, mask=tk, other=0, volatile=True),
        prompt_len=tl.load(ring_u32 + (rec + RECORD.prompt_len) // 4, volatile=True).to(tl.int64),
        max_tokens=tl.load(ring_u32 + (rec + RECORD.max_tokens) // 4, volatile=True).to(tl.int64),
        temperature=tl.load(ring_f64 + (rec + RECORD.temperature) // 8, mask=tk, other=0.0, volatile=True),
        top_p=tl.load(ring_f64 + (rec + RECORD.top_p) // 8, mask=tk, other=1.0, volatile=True),
        min_p=tl.load(ring_f64 + (rec + RECORD.min_p) // 8, mask=tk, other=0.0, volatile=True),
        top_k=tl.load(ring_i32 + (rec + RECORD.top_k) // 4, mask=tk, other=0, volatile=True),
        has_seed=tl.load(ring_u32 + (rec + RECORD.has_seed) // 4, volatile=True).to(tl.int64),
        ignore_eos=tl.load(ring_u32 + (rec + RECORD.ignore_eos) // 4, volatile=True).to(tl.int64),
        n_stop=tl.load(ring_u32 + (rec + RECORD.n_stop) // 4, volatile=True).to(tl.int64),
        logprobs=tl.load(ring_u32 + (rec + RECORD.logprobs) // 4, volatile=True).to(tl.int64),
        prompt_logprobs=tl.load(ring_u32 + (rec + RECORD.prompt_logprobs) // 4, volatile=True).to(tl.int64),
        lp_offset=tl.load(ring_i64 + (rec + RECORD.lp_offset) // 8, mask=tk, other=0, volatile=True),
        presence_penalty=tl.load(
            ring_f64 + (rec + RECORD.presence_penalty) // 8, mask=tk, other=0.0, volatile=True
        ),
        frequency_penalty=tl.load(
            ring_f64 + (rec + RECORD.frequency_penalty) // 8, mask=tk, other=0.0, volatile=True
        ),
        repetition_penalty=tl.load(
            ring_f64 + (rec + RECORD.repetition_penalty) // 8, mask=tk, other=1.0, volatile=True
        ),
        n_bias=tl.load(ring_u32 + (rec + RECORD.n_bias) // 4, volatile=True).to(tl.int64),
        constraint_len=tl.load(ring_u32 + (rec + RECORD.constraint_len) // 4, volatile=True).to(tl.int64),
        constraint_offset=tl.load(
            ring_i64 + (rec + RECORD.constraint_offset) // 8, mask=tk, other=0, volatile=True
        ),
    )


@triton.jit
def _check_records(
    recs, tk, rec, arena_head, c_gen, c_cancel, p_done, ring_ptr, bias_bad,
    ARENA_TOKENS: tl.constexpr, MAX_PROMPT: tl.constexpr, MAX_INFLIGHT: tl.constexpr,
    MAX_OUTPUT: tl.constexpr, MAX_STOP: tl.constexpr, AREAS: tl.constexpr, MAX_MODEL_LEN: tl.constexpr,
    VOCAB: tl.constexpr, BLOCK_STOP: tl.constexpr, PBS: tl.constexpr, ERROR: tl.constexpr,
    RECORD: tl.constexpr,
):  # fmt: skip
    """Checks that need nothing but the record, in engine_server's order: `local` (1 unaddressable,
    2 prompt length, 3 arena range) and `later` (the ErrorCode, or _CANCELLED, of the checks after
    the prompt's); the ones that depend on earlier records (channel in use, duplicate id,
    arena_tail, prompt tokens) are _place_records'. Also returns the stop ids and their mask."""
    r_off, r_end, r_plen, r_gen = recs.prompt_offset, recs.arena_end, recs.prompt_len, recs.generation
    r_temp, r_top_p, r_min_p = recs.temperature, recs.top_p, recs.min_p
    r_words = r_plen  # its arena words: the prompt, then its block hashes when the ring has them
    if PBS > 0:
        r_words += 4 * (r_plen // PBS)
    local = tl.where(
        (recs.chan >= MAX_INFLIGHT) | (r_gen == 0) | (c_gen != r_gen) | (p_done == r_gen), 1,
        tl.where((r_plen < 1) | (r_plen > MAX_PROMPT), 2,
        tl.where((r_off < 0) | (r_end != r_off + r_words) | (r_end > arena_head)
                 | ((r_off % ARENA_TOKENS) + r_words > ARENA_TOKENS), 3, 0)),
    )  # fmt: skip
    jj = tl.arange(0, BLOCK_STOP)
    stop_m = tk[:, None] & (jj[None, :] < tl.minimum(recs.n_stop, MAX_STOP)[:, None])
    stop_ids = tl.load(
        ring_ptr.to(tl.pointer_type(tl.int32)) + (rec[:, None] + RECORD.stop_ids + 4 * jj[None, :]) // 4,
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
    r_has_seed = recs.has_seed
    params_bad = (
        (r_has_seed > 1) | (recs.ignore_eos > 1) | ~finite
        | ~(r_temp >= 0.0) | ~((r_top_p > 0.0) & (r_top_p <= 1.0)) | (recs.top_k < 0)
        | ~((r_min_p >= 0.0) & (r_min_p <= 1.0)) | ((r_has_seed == 1) & (recs.seed < 0))
        | ~((recs.presence_penalty >= -2.0) & (recs.presence_penalty <= 2.0))
        | ~((recs.frequency_penalty >= -2.0) & (recs.frequency_penalty <= 2.0))
        | ~(((recs.repetition_penalty > 0.0) & (recs.repetition_penalty <= 2.0)) | (recs.repetition_penalty == 0.0))
        | bias_bad | ((recs.constraint_len > 0) & (recs.ignore_eos == 1))
    )  # fmt: skip
    c_outside, c_bad = check_constraint(recs, ring_ptr, AREAS)
    # Logprobs (engine_server._decode_logprobs's order): N + 1 in [1, 21] or 0, prompt scoring 0 or 1
    # and only with N, then the rows (prompt positions', then output tokens') inside the area.
    r_max_tokens = recs.max_tokens
    r_prompt_lp = recs.prompt_logprobs
    lp_bad = (recs.logprobs > AREAS.max_top_n + 1) | (r_prompt_lp > 1) | ((r_prompt_lp == 1) & (recs.logprobs == 0))  # fmt: skip
    lp_rows = r_max_tokens + tl.where(r_prompt_lp == 1, r_plen - 1, 0)
    lp_outside = (recs.logprobs > 0) & (recs.lp_offset + lp_rows * recs.logprobs > AREAS.pairs)
    # After the prompt checks: _decode's remaining checks, then the cancel word, then
    # LLMEngine.add_request's length limit.
    later = tl.where(recs.n_stop > MAX_STOP, ERROR.STOP_IDS,
            tl.where(stop_bad, ERROR.STOP_IDS,
            tl.where((r_max_tokens < 1) | (r_max_tokens > MAX_OUTPUT), ERROR.MAX_TOKENS,
            tl.where(lp_bad, ERROR.INVALID_PARAMS,
            tl.where(lp_outside, ERROR.BAD_RECORD,
            tl.where(params_bad, ERROR.INVALID_PARAMS,
            tl.where(c_outside, ERROR.BAD_RECORD,
            tl.where(c_bad, ERROR.INVALID_PARAMS,
            tl.where(c_cancel == r_gen, _CANCELLED,
            tl.where(r_plen > MAX_MODEL_LEN, ERROR.ENGINE_REJECTED, 0))))))))))  # fmt: skip
    return local, later, stop_m, stop_ids


@triton.jit
def _stage_biases(ring_ptr, rec, tk, n_bias, slots, VOCAB: tl.constexpr, MAX_BIAS: tl.constexpr,
                  BIAS_TILE: tl.constexpr, BLOCK_R: tl.constexpr, RECORD: tl.constexpr):  # fmt: skip
    """Copy each record's logit_bias out of the ring (once: what is checked is what is used) into the
    scheduler's stage, row r for record r; returns which records have an entry outside the
    vocabulary or outside [-100, 100], or more entries than a record holds."""
    offs_r = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BIAS_TILE)
    bad = n_bias > MAX_BIAS
    for r in range(BLOCK_R):
        mine = offs_r == r
        n = tl.minimum(tl.sum(tl.where(mine & tk, n_bias, 0), 0), MAX_BIAS)
        base = tl.sum(tl.where(mine, rec, 0), 0)
        wrong = tl.full([], 0, tl.int32)
        for j0 in range(0, n, BIAS_TILE):
            m = j0 + jj < n
            ids = tl.load(ring_ptr.to(tl.pointer_type(tl.int32)) + (base + RECORD.bias_ids) // 4 + j0 + jj,
                          mask=m, other=0, volatile=True)  # fmt: skip
            values = tl.load(ring_ptr.to(tl.pointer_type(tl.float32)) + (base + RECORD.bias_values) // 4 + j0 + jj,
                             mask=m, other=0.0, volatile=True)  # fmt: skip
            tl.store(slots.bias_stage_ids + r * MAX_BIAS + j0 + jj, ids, mask=m)
            tl.store(slots.bias_stage_values + r * MAX_BIAS + j0 + jj, values, mask=m)
            out = (ids < 0) | (ids >= VOCAB) | ~((values >= -100.0) & (values <= 100.0))
            wrong = tl.maximum(wrong, tl.max((m & out).to(tl.int32), 0))
        bad = bad | (mine & (wrong > 0))
    return bad


@triton.jit
def _move_biases(r_slot, r_outcome, tk, n_bias, slots, MAX_BIAS: tl.constexpr, BIAS_TILE: tl.constexpr,
                 BLOCK_R: tl.constexpr):  # fmt: skip
    """The staged logit_bias of each admitted record into its slot."""
    offs_r = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BIAS_TILE)
    for r in range(BLOCK_R):
        mine = (offs_r == r) & tk & (r_slot >= 0) & (r_outcome == 0)
        n = tl.sum(tl.where(mine, tl.minimum(n_bias, MAX_BIAS), 0), 0)
        slot = tl.sum(tl.where(mine, r_slot, 0), 0)
        for j0 in range(0, n, BIAS_TILE):
            m = j0 + jj < n
            ids = tl.load(slots.bias_stage_ids + r * MAX_BIAS + j0 + jj, mask=m, other=0)
            values = tl.load(slots.bias_stage_values + r * MAX_BIAS + j0 + jj, mask=m, other=0.0)
            tl.store(slots.bias_ids + slot * MAX_BIAS + j0 + jj, ids, mask=m)
            tl.store(slots.bias_values + slot * MAX_BIAS + j0 + jj, values, mask=m)


@triton.jit
def _place_records(
    ch_d, arena_tail, free_d, st, md, recs, local, later, arena_head, n_records, ring_ptr, slots,
    OFF_ARENA: tl.constexpr, ARENA_TOKENS: tl.constexpr, MAX_MODEL_LEN: tl.constexpr, VOCAB: tl.constexpr,
    PBS: tl.constexpr, HSTRIDE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, SLOT: tl.constexpr, ERROR: tl.constexpr,
):  # fmt: skip
    """One record at a time, in ring order, against the slots as the earlier records left them:
    the lowest free slot, unless the record is unaddressable; its prompt copied into the slot's
    tokens while its ids are checked. Returns (each record's slot or -1, its outcome: 0 admitted,
    an ErrorCode, _CANCELLED or _UNADDRESSABLE; arena_tail after releasing the records' prompts)."""
    ring_i32 = ring_ptr.to(tl.pointer_type(tl.int32))
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    r_chan, r_rid, r_off, r_plen, r_end = (
        recs.chan,
        recs.request_id,
        recs.prompt_offset,
        recs.prompt_len,
        recs.arena_end,
    )
    nonfree = md & (st != SLOT.FREE)
    live_req = md & ((st == SLOT.WAITING) | (st == SLOT.RUNNING))
    rid_d = tl.load(slots.request_id + offs_d, mask=md, other=0)
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
        unaddressable = (loc == 1) | (tl.sum((nonfree & (ch_d.to(tl.int64) == c)).to(tl.int32), 0) > 0)
        s = tl.min(tl.where(free_d, offs_d, BLOCK_D), 0)
        duplicate = tl.sum((live_req & (rid_d == rid)).to(tl.int32), 0) > 0
        code = tl.where(duplicate, ERROR.BAD_RECORD,
               tl.where(loc == 2, ERROR.PROMPT_LENGTH,
               tl.where((loc == 3) | (off < arena_tail), ERROR.BAD_RECORD, 0)))  # fmt: skip
        # Copy the prompt into the slot while checking its ids (only a validated arena range).
        n_copy = tl.where(unaddressable | (code != 0), 0, plen)
        src = OFF_ARENA + 4 * (off % ARENA_TOKENS)
        bad_token = tl.full([], 0, tl.int32)
        for p0 in range(0, n_copy, BLOCK_P):
            p = p0 + offs_p
            pm = p < n_copy
            tok = tl.load(ring_i32 + (src + 4 * p) // 4, mask=pm, other=0, volatile=True)
            bad_token = tl.maximum(bad_token, tl.sum((pm & ((tok < 0) | (tok >= VOCAB))).to(tl.int32), 0))
            tl.store(slots.token_ids + s * MAX_MODEL_LEN + p, tok, mask=pm & (p < MAX_MODEL_LEN))
        code = tl.where((code == 0) & (bad_token > 0), ERROR.TOKEN_OUT_OF_VOCAB, code)
        if PBS > 0:  # its block hashes follow it in the arena (docs/protocol.md, "Token arena")
            _copy_hashes(ring_i32, src + 4 * n_copy, tl.where(n_copy > 0, n_copy // PBS, -1), s, slots, HSTRIDE,
                         BLOCK_P)  # fmt: skip
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
        # wire/lifecycle.release_arena, for every record (also unaddressable ones): clamped to the
        # head, and never backwards even when an overwritten head word reads below the tail.
        arena_tail = tl.maximum(tl.minimum(tl.sum(tl.where(is_r, r_end, 0), 0), arena_head), arena_tail)
    return r_slot, r_outcome, arena_tail


@triton.jit
def _fill_record_slots(
    recs, tk, r_slot, r_outcome, stop_m, stop_ids, next_arrival, n_cancelled, engine_seed, slots,
    MAX_STOP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_STOP: tl.constexpr,
    SLOT: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """Fill the slots the records took: WAITING for admitted ones, FINISHING (commit publishes the
    terminal event) for rejected and cancelled ones. Returns how many records were admitted and
    rejected, n_cancelled plus the cancelled ones, and how many were unaddressable."""
    r_plen, r_has_seed = recs.prompt_len, recs.has_seed
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
    seed = tl.where(r_has_seed == 1, recs.seed, _derived_seed(engine_seed, recs.request_id))
    tl.store(slots.slot_state + sl, tl.where(adm_r, SLOT.WAITING, SLOT.FINISHING), mask=took)
    tl.store(
        slots.finish_reason + sl,
        tl.where(adm_r, 0, tl.where(cancelled_r, FINISH.ABORT, FINISH.ERROR)),
        mask=took,
    )
    tl.store(slots.error_code + sl, tl.where(rejected_r, r_outcome, 0), mask=took)
    tl.store(slots.chan + sl, recs.chan.to(tl.int32), mask=took)
    tl.store(slots.generation + sl, recs.generation, mask=took)
    tl.store(slots.request_id + sl, recs.request_id, mask=took)
    tl.store(slots.priority + sl, recs.priority, mask=took)
    tl.store(
        slots.arrival + sl,
        next_arrival + (tl.cumsum(adm_r.to(tl.int64), 0) - adm_r.to(tl.int64)),
        mask=took,
    )
    tl.store(slots.prompt_len + sl, plen_kept, mask=took)
    tl.store(slots.num_tokens + sl, plen_kept, mask=took)
    tl.store(slots.num_computed + sl, tl.zeros([BLOCK_R], tl.int32), mask=took)
    tl.store(slots.num_blocks + sl, tl.zeros([BLOCK_R], tl.int32), mask=took)
    tl.store(slots.max_tokens + sl, recs.max_tokens.to(tl.int32), mask=adm_r)
    tl.store(slots.temperature + sl, recs.temperature.to(tl.float32), mask=adm_r)
    tl.store(slots.top_p + sl, recs.top_p.to(tl.float32), mask=adm_r)
    tl.store(slots.top_k + sl, recs.top_k, mask=adm_r)
    tl.store(slots.min_p + sl, recs.min_p.to(tl.float32), mask=adm_r)
    tl.store(slots.seed + sl, seed, mask=adm_r)
    tl.store(slots.ignore_eos + sl, recs.ignore_eos.to(tl.int32), mask=adm_r)
    tl.store(slots.n_stop + sl, recs.n_stop.to(tl.int32), mask=adm_r)
    tl.store(slots.lp_top_n + sl, (recs.logprobs - 1).to(tl.int32), mask=adm_r)
    # Output token i's row is prompt_len - 1 + i when the prompt is scored (ring_layout.output_logprob_row).
    scored = recs.prompt_logprobs == 1
    tl.store(
        slots.lp_offset + sl, recs.lp_offset + tl.where(scored, (r_plen - 1) * recs.logprobs, 0), mask=adm_r
    )
    tl.store(slots.lp_next + sl, tl.where(scored, 1, r_plen).to(tl.int32), mask=adm_r)
    repetition = tl.where(recs.repetition_penalty == 0.0, 1.0, recs.repetition_penalty).to(tl.float32)
    presence, frequency = recs.presence_penalty.to(tl.float32), recs.frequency_penalty.to(tl.float32)
    penalized = (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0) | (recs.n_bias > 0)
    tl.store(slots.presence_penalty + sl, presence, mask=adm_r)
    tl.store(slots.frequency_penalty + sl, frequency, mask=adm_r)
    tl.store(slots.repetition_penalty + sl, repetition, mask=adm_r)
    tl.store(slots.n_bias + sl, recs.n_bias.to(tl.int32), mask=adm_r)
    tl.store(slots.penalized + sl, penalized.to(tl.int32), mask=adm_r)
    jj = tl.arange(0, BLOCK_STOP)
    stop_row = tl.where(stop_m, stop_ids, -1)
    tl.store(
        slots.stop_ids + sl[:, None] * MAX_STOP + jj[None, :],
        stop_row,
        mask=adm_r[:, None] & (jj[None, :] < MAX_STOP),
    )
    return n_admitted, n_rejected, n_cancelled, n_unaddressable


@triton.jit
def _derived_seed(engine_seed, request_id):
    """mix(engine_seed + (request_id + 1) * GAMMA) with the top bit cleared: rng.row_keys of
    (engine_seed, request_id), so the host can recompute it; in [0, 2**63) like a client seed."""
    z = engine_seed + (request_id + 1) * _GAMMA
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return z & _INT64_MAX


@triton.jit
def _copy_hashes(ring_i32, src, n_hashes, s, slots, HSTRIDE: tl.constexpr, BLOCK_P: tl.constexpr):
    """A prompt's block hashes (4 words each, from byte offset src of the ring) into slot s."""
    offs_p = tl.arange(0, BLOCK_P)
    for p0 in range(0, 4 * n_hashes, BLOCK_P):  # none when n_hashes is -1 (nothing to copy)
        p = p0 + offs_p
        pm = p < 4 * n_hashes
        word = tl.load(ring_i32 + (src + 4 * p) // 4, mask=pm, other=0, volatile=True)
        tl.store(slots.prefix_hash + s * HSTRIDE + p, word, mask=pm)
    tl.store(slots.n_hashes + s, n_hashes, mask=n_hashes >= 0)
