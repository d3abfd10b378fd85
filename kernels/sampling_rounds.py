"""The rejection variant's rounds in one launch: a work queue of passes over a row's chunks.

A task is one pass of one row over its chunks: the first race (tasks [0, n_rows), implied), a race
in a shrunken region, a top-p / top-k test, or a level of a top-k threshold's select (queued).
Persistent programs take tickets of a few chunks each, in task order; the program that completes a
row's pass decides the row and queues its next pass, if any. So rows still undecided cost what they
read, with no launch, barrier or scan over settled rows between rounds, and one row's test overlaps
other rows' races.

A program whose ticket names a task not queued yet waits for it, or for every row to settle. That
cannot deadlock: a ticket is only taken by a running program, and a task is queued once its row's
earlier pass, whose tickets all come before, is done. Rows still undecided after `rounds` races are
left to `finish` (kernels/sampling_finish.py), which is exact. The last program out resets the
queue for the next step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from blink_appliance.kernels.sampling_finish import FINISH_CAP, _finish_kernel
from blink_appliance.kernels.sampling_gather import (
    GATHER_CAP,
    GATHER_NEXT,
    GATHERED,
    _after_gathering,
    _chunk_bound,
    _gather_chunk,
    _gathering,
)
from blink_appliance.kernels.sampling_rejection import (
    COUNTER_STRIDE,
    MAX_ROUNDS,
    QUEUE_COUNTERS,
    RejectionRows,
    SampleRows,
    _decide_row,
    _last_to_arrive,
    _mass_chunk,
    _persistent,
    _pick_row,
    _race_chunk,
    _select_row,
)
from blink_appliance.kernels.sampling_select import _select_chunk

# RejectionRows.counters, a 128-byte line each: the programs waiting on SETTLED don't slow the takes
# of NEXT_TICKET.
NEXT_TICKET = tl.constexpr(0 * COUNTER_STRIDE)
TAIL = tl.constexpr(1 * COUNTER_STRIDE)
SETTLED = tl.constexpr(2 * COUNTER_STRIDE)
OUT = tl.constexpr(3 * COUNTER_STRIDE)
LINES = tl.constexpr(QUEUE_COUNTERS)
LINE = tl.constexpr(COUNTER_STRIDE)
# A task's kind (payload = row * 4 + kind); tasks [0, n_rows) are the rows' first races.
FIRST_RACE = tl.constexpr(0)
RACE = tl.constexpr(1)
TEST = tl.constexpr(2)
SELECT = tl.constexpr(3)  # a level of a top-k with top-p row's threshold select (sampling_select.py)
# A top-k row's gathering pass (sampling_gather.py); queued as kind 0, since first races never are.
GATHER = tl.constexpr(4)
TICKET_CHUNKS = 1  # chunks a ticket: fewer takes of the one counter, and of the rows' arrival counts
MAX_REGISTERS = 64  # per thread, on a GPU: 8 programs an SM (uncapped it takes 80-96, 5-6 an SM)
NUM_WARPS = 4
REGISTERS_PER_SM = 65536  # sm_90's register file, in 32-bit registers


@triton.jit
def _await_task(queue_ptr, counters_ptr, slot, queue_size, n_rows, SLEEP: tl.constexpr):
    """The payload queued at `slot`, once it is; -1 when every row has settled first (so none will
    be). Spins on plain loads, sleeping 1 µs between them (SLEEP, on a GPU) so that waiting warps leave
    the issue slots and the counters' lines to working ones; the acquire after it makes the row state
    its producer wrote visible."""
    payload = tl.full([], -1, tl.int32)
    waiting = payload < 0
    while waiting:
        if SLEEP:  # 1 µs beat 100 ns on the H100 (bench/results/2026-11-28-h100-sampler-rounds-queue.md)
            tl.inline_asm_elementwise(
                "nanosleep.u32 1000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )
        if slot < queue_size:
            payload = tl.load(queue_ptr + slot, volatile=True)
        waiting = (payload < 0) & (tl.load(counters_ptr + SETTLED, volatile=True) < n_rows)
    if payload >= 0:
        payload = tl.atomic_add(queue_ptr + slot, 0, sem="acquire")
    return payload


@triton.jit
def _queue(queue_ptr, counters_ptr, r, kind):
    """Queue row r's next pass; the release publishes the row state written before it."""
    slot = tl.atomic_add(counters_ptr + TAIL, 1, sem="relaxed")
    tl.atomic_xchg(queue_ptr + slot, r * 4 + kind % 4, sem="release")


@triton.jit
def _after_pass(r, status, first, queue_ptr, counters_ptr, races_ptr, ROUNDS: tl.constexpr):
    """Row r's pass is decided with `status`: queue its test (2), its select level (3), its gathering
    pass (GATHER_NEXT), its next race (1) while it has had fewer than ROUNDS, or count it settled
    (done, or left to `finish`). `first`: the pass was the row's first race, whose count of 1 one
    thread has just stored (a warp ahead could still load the last step's), so it is not read back."""
    races = tl.where(first, 1, tl.load(races_ptr + r))
    # Every thread branches on its own load of races[r]; one thread writes it below. Without the
    # barrier a warp that loads late could read the new count, take the other branch and never meet
    # the barriers of the atomics in this one.
    tl.debug_barrier()
    if (status == 2) | (status == GATHER_NEXT):
        _queue(queue_ptr, counters_ptr, r, tl.where(status == 2, TEST, GATHER))
    elif status == 3:
        _queue(queue_ptr, counters_ptr, r, SELECT)
    elif (status == 1) & (races < ROUNDS):
        tl.store(races_ptr + r, races + 1)
        _queue(queue_ptr, counters_ptr, r, RACE)
    else:
        tl.atomic_add(counters_ptr + SETTLED, 1, sem="release")


@triton.jit
def _leave(queue_ptr, counters_ptr, active, BLOCK: tl.constexpr):
    """Count this program out; the last of the `active` ones resets the queue's slots and counters
    for the next step."""
    if tl.atomic_add(counters_ptr + OUT, 1, sem="acq_rel") == active - 1:
        tail = tl.load(counters_ptr + TAIL)
        for start in range(0, tail, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(queue_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < tail)
        tl.debug_barrier()  # every warp has read TAIL (its share of the slots) before TAIL is zeroed
        tl.store(counters_ptr + tl.arange(0, LINES) * LINE, tl.zeros([LINES], tl.int32))


@triton.jit
def _pass_chunks(
    r, start, stop, kind, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr,
    out_index_ptr, sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr,
    cut_ptr, select_ptr, select_hist_ptr, part_score_ptr, part_index_ptr, part_max_ptr, part_sum_ptr, part_hist_ptr,
    gather_ptr, gathered_ptr, arrived_ptr, races_ptr, queue_ptr, counters_ptr, V, n_chunks, ROUNDS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, PRECISE: tl.constexpr, TOP_K: tl.constexpr, BOTH: tl.constexpr,
    GATHER_CAP: tl.constexpr,
):  # fmt: skip
    """Chunks [start, stop) of a pass of row r; the program that completes the pass decides the row
    and queues what follows. A test's partial masses reuse part_sum (the row's first pick folded its
    sums into row_lse), its counts part_index (the race's pick has read it) and its top-k set's masses
    part_max (the first pick's). A gathering pass, or a select pass of a row with both at GATHERING,
    appends the row's candidates (sampling_gather.py)."""
    select = False  # a select pass: only rows with both queue one, so it is compiled in with BOTH alone
    gather = False  # a pass that gathers the row's candidates: GATHER, or a select pass at GATHERING
    if BOTH:  # (an empty select branch still cost the other variants' registers)
        select = kind == SELECT
        if select & (GATHER_CAP > 0):
            gather = _gathering(r, select_ptr)
    if GATHER_CAP > 0:  # (compiled only where a row can gather: the variants with top-k)
        gather = gather | (kind == GATHER)
    for c in range(start, stop):
        if gather:
            if GATHER_CAP > 0:
                _gather_chunk(
                    r, c, logits_ptr, stride, temperature_ptr, gather_ptr, gathered_ptr, V, CHUNK, GATHER_CAP,
                    PRECISE,
                )  # fmt: skip
        elif select:
            _select_chunk(
                r, c, logits_ptr, stride, temperature_ptr, select_ptr, select_hist_ptr, V, CHUNK, PRECISE
            )
        elif kind == TEST:
            _mass_chunk(
                r, c, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, candidate_ptr, row_max_ptr,
                row_lse_ptr, select_ptr, part_sum_ptr, part_index_ptr, part_hist_ptr, part_max_ptr, V, n_chunks,
                CHUNK, PRECISE, TOP_K, BOTH,
            )  # fmt: skip
        elif kind == FIRST_RACE:
            _race_chunk(
                r, c, logits_ptr, stride, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_index_ptr,
                bound_x_ptr, bound_i_ptr, row_max_ptr, cut_ptr, select_ptr, part_score_ptr, part_index_ptr,
                part_max_ptr, part_sum_ptr, V, n_chunks, CHUNK, FIRST=True, ARGMAX=False, PRECISE=PRECISE,
                TOP_K=TOP_K, BOTH=BOTH,
            )  # fmt: skip
        else:
            _race_chunk(
                r, c, logits_ptr, stride, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_index_ptr,
                bound_x_ptr, bound_i_ptr, row_max_ptr, cut_ptr, select_ptr, part_score_ptr, part_index_ptr,
                part_max_ptr, part_sum_ptr, V, n_chunks, CHUNK, FIRST=False, ARGMAX=False, PRECISE=PRECISE,
                TOP_K=TOP_K, BOTH=BOTH,
            )  # fmt: skip
    if _last_to_arrive(arrived_ptr, r, n_chunks, stop - start):
        if gather & select:  # the finisher ranks the candidates (its registers are not capped)
            status = tl.full([], GATHERED, tl.int32)
            tl.store(status_ptr + r, status)
        elif select:
            status = _select_row(
                r, logits_ptr, stride, temperature_ptr, top_k_ptr, sampled_ptr, status_ptr, bound_x_ptr,
                bound_i_ptr, candidate_ptr, select_ptr, select_hist_ptr, gather_ptr, PRECISE, GATHER_CAP,
            )  # fmt: skip
        elif gather:  # a gathering pass
            status = _after_gathering(r, status_ptr, gather_ptr, GATHER_CAP)
        elif kind == TEST:
            status = _decide_row(
                r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, sampled_ptr, status_ptr,
                bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, cut_ptr, select_ptr, part_sum_ptr,
                part_index_ptr, part_hist_ptr, part_max_ptr, V, n_chunks, BLOCK_C, PRECISE, TOP_K, BOTH,
            )  # fmt: skip
        elif kind == FIRST_RACE:
            tl.store(races_ptr + r, 1)
            status, above = _pick_row(
                r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, sampled_ptr, status_ptr,
                bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, part_score_ptr,
                part_index_ptr, part_max_ptr, part_sum_ptr, n_chunks, BLOCK_C, FIRST=True, ARGMAX=False,
                PRECISE=PRECISE, TOP_K=TOP_K,
            )  # fmt: skip
            if GATHER_CAP > 0:
                status = _chunk_bound(r, status, above, top_k_ptr, part_max_ptr, status_ptr, gather_ptr, n_chunks,
                                      BLOCK_C)  # fmt: skip
        else:
            status, _ = _pick_row(
                r, logits_ptr, stride, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, sampled_ptr, status_ptr,
                bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, part_score_ptr,
                part_index_ptr, part_max_ptr, part_sum_ptr, n_chunks, BLOCK_C, FIRST=False, ARGMAX=False,
                PRECISE=PRECISE, TOP_K=TOP_K,
            )  # fmt: skip
        _after_pass(r, status, kind == FIRST_RACE, queue_ptr, counters_ptr, races_ptr, ROUNDS)


@triton.jit
def _rounds_kernel(
    logits_ptr, stride, n_rows_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr,
    sampled_ptr, status_ptr, bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, cut_ptr,
    select_ptr, select_hist_ptr, part_score_ptr, part_index_ptr, part_max_ptr, part_sum_ptr, part_hist_ptr,
    gather_ptr, gathered_ptr, arrived_ptr, races_ptr, queue_ptr, counters_ptr, V, n_chunks, queue_size,
    ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr, GROUP: tl.constexpr, PRECISE: tl.constexpr, SLEEP: tl.constexpr, TOP_K: tl.constexpr,
    BOTH: tl.constexpr, GATHER_CAP: tl.constexpr = 0,
):  # fmt: skip
    n_rows = tl.load(n_rows_ptr)
    groups = tl.cdiv(n_chunks, GROUP)
    # A row has one pass in flight at a time, so no more than a pass's tickets per row can be busy:
    # the grid is sized for max_seqs rows, and the programs past those leave before touching a counter.
    active = tl.minimum(tl.num_programs(0), n_rows * groups)
    running = tl.program_id(0) < active
    while running:
        ticket = tl.atomic_add(counters_ptr + NEXT_TICKET, 1, sem="relaxed")
        task = ticket // groups
        payload = task * 4 + FIRST_RACE
        queued = task >= n_rows
        if queued:
            payload = _await_task(queue_ptr, counters_ptr, task - n_rows, queue_size, n_rows, SLEEP)
        running = payload >= 0
        if running:
            start = (ticket % groups) * GROUP
            kind = payload % 4
            kind = tl.where(queued & (kind == FIRST_RACE), GATHER, kind)
            _pass_chunks(
                payload // 4, start, tl.minimum(start + GROUP, n_chunks), kind, logits_ptr, stride,
                temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, out_index_ptr, sampled_ptr, status_ptr,
                bound_x_ptr, bound_i_ptr, candidate_ptr, row_max_ptr, row_lse_ptr, cut_ptr, select_ptr,
                select_hist_ptr, part_score_ptr, part_index_ptr, part_max_ptr, part_sum_ptr, part_hist_ptr,
                gather_ptr, gathered_ptr, arrived_ptr, races_ptr, queue_ptr, counters_ptr, V, n_chunks, ROUNDS, CHUNK,
                BLOCK_C, PRECISE, TOP_K, BOTH, GATHER_CAP,
            )  # fmt: skip
    if tl.program_id(0) < active:
        _leave(queue_ptr, counters_ptr, active, 256)


def race_and_test(
    logits: torch.Tensor,
    rows: SampleRows,
    state: RejectionRows,
    sampled: torch.Tensor,
    *,
    chunk: int,
    rounds: int,
    programs: int,
    precise: bool,
    top_k: bool = True,
    both: bool = False,
    ticket_chunks: int = TICKET_CHUNKS,
    max_registers: int | None = MAX_REGISTERS,
    finish_block: int = 2048,
    gather_cap: int = GATHER_CAP,
) -> None:
    """sampled[r] = the race winner over row r's kept tokens, r < n_rows: up to `rounds` chunked
    races per row (each followed by its top-p / top-k test) in one launch, then `finish` for any row
    still undecided. `top_k`: rows may have top-k (its count and cut are compiled in; without them the
    kernel keeps the registers and speed of top-p rows alone); `both`: rows may have top-k and top-p
    (their select is compiled in too, which costs rows of top-k alone). `max_registers` caps the queue kernel's
    registers per thread (more programs per SM). `gather_cap`: with `top_k` or `both`, the most candidates a
    top-k row gathers to be decided from (sampling_gather.py; 0: never, else a power of two that
    state.gathered holds).
    Capturable: no host sync."""
    S, V = logits.shape
    C = state.part_score.shape[1]
    if C != triton.cdiv(V, chunk):
        raise ValueError(
            f"partials have {C} chunks; vocab {V} in chunks of {chunk} needs {triton.cdiv(V, chunk)}"
        )
    if not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"the rejection sampler takes 1 to {MAX_ROUNDS} chunked rounds, got {rounds}")
    if gather_cap & (gather_cap - 1) or gather_cap > state.gathered.shape[1]:
        raise ValueError(
            f"the gather cap is sorted in one program: a power of two or 0, at most the "
            f"{state.gathered.shape[1]} state.gathered holds, got {gather_cap}"
        )
    gather_cap = gather_cap if top_k or both else 0  # only rows with top-k gather
    registers = {"maxnreg": max_registers} if max_registers and logits.is_cuda else {}
    if registers:
        # No more programs than fit at once: one past them gets a slot only when a resident one
        # leaves, after every row has settled, and then only leaves itself.
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
        programs = min(programs, sms * (REGISTERS_PER_SM // (max_registers * 32 * NUM_WARPS)))
    _rounds_kernel[(_persistent(S * C, programs),)](
        logits, logits.stride(0), rows.n_rows, rows.temperature, rows.top_p, rows.top_k, rows.min_p, rows.seed,
        rows.output_index, sampled, state.status, state.bound_x, state.bound_i, state.candidate,
        state.row_max, state.row_lse, state.cut, state.select, state.select_hist, state.part_score,
        state.part_index, state.part_max, state.part_sum, state.part_hist, state.gather, state.gathered,
        state.arrived, state.races, state.queue, state.counters, V, C, state.queue.numel(), ROUNDS=rounds, CHUNK=chunk,
        BLOCK_C=triton.next_power_of_2(C), GROUP=ticket_chunks, PRECISE=precise, SLEEP=logits.is_cuda,
        TOP_K=top_k or both, BOTH=both, GATHER_CAP=gather_cap, num_warps=NUM_WARPS, **registers,
    )  # fmt: skip
    _finish_kernel[(S,)](
        logits, logits.stride(0), rows.n_rows, rows.temperature, rows.top_p, rows.top_k, rows.min_p, rows.seed,
        rows.output_index, sampled, state.status, state.bound_x, state.bound_i, state.candidate,
        state.row_max, state.row_lse, state.select, state.gather, state.gathered, V,
        BLOCK=min(finish_block, triton.next_power_of_2(V)), CAP=FINISH_CAP, PRECISE=precise, BOTH=both,
        GATHER_CAP=gather_cap, num_warps=8,
    )  # fmt: skip
