"""Triton kernels of structured output in the GPU loop (engine/loop/constraint.py): check and copy
each admitted record's automaton (schedule's record intake), mask each constrained sample row's
logits to its automaton state's tokens, and move the state by the sampled token. The automata live in the device's copy of the ring's constraint area, in the CSR words of
wire/automaton.py; a slot's `c_offset` is its automaton's first word (-1: unconstrained).

`_mask_kernel`, persistent over (row, vocabulary chunk) items: the state's edges are sorted by
token, so two binary searches find those inside the chunk; their logits are gathered, the chunk is
set to -inf, and they (and the end-of-sequence ids, in an accepting state) are written back.
`_advance_kernel`, one program over the rows: the sampled token's edge by binary search, its target
is the slot's new state (end of sequence leaves it: the request ends).
"""

from __future__ import annotations

import triton
import triton.language as tl

HEADER = tl.constexpr(3)  # n_states, initial, n_edges


@triton.jit
def _edges(arena_ptr, off, state):
    """(first edge, end) of `state` and where the tokens and targets start, as word indices."""
    n = tl.load(arena_ptr + off)
    n_edges = tl.load(arena_ptr + off + 2)
    starts = off + HEADER + n
    tokens = starts + n + 1
    return (
        tl.load(arena_ptr + starts + state),
        tl.load(arena_ptr + starts + state + 1),
        tokens,
        tokens + n_edges,
    )


@triton.jit
def _lower_bounds(arena_ptr, tokens, first, end, values, STEPS: tl.constexpr):
    """For each of `values` (a vector), the first edge in [first, end) whose token is >= it (tokens
    ascending); the searches run side by side, so their loads overlap."""
    lo = tl.zeros_like(values).to(tl.int64) + first
    hi = tl.zeros_like(values).to(tl.int64) + end
    for _ in range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(arena_ptr + tokens + mid, mask=open_, other=0) < values
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    return lo


@triton.jit
def _mask_kernel(
    logits_ptr, stride, n_rows_ptr, sample_slot_ptr, c_offset_ptr, c_state_ptr, arena_ptr, eos_ptr, V, n_chunks,
    CHUNK: tl.constexpr, MAX_EOS: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    n_items = tl.load(n_rows_ptr) * n_chunks
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        r = item // n_chunks
        slot = tl.load(sample_slot_ptr + r)
        off = tl.load(c_offset_ptr + tl.maximum(slot, 0))
        if (slot >= 0) & (off >= 0):
            c0 = (item % n_chunks) * CHUNK
            state = tl.load(c_state_ptr + slot)
            first, end, tokens, _ = _edges(arena_ptr, off, state)
            pair = tl.arange(0, 2)
            bounds = _lower_bounds(arena_ptr, tokens, first, end, c0 + pair * CHUNK, STEPS)
            lo = tl.sum(tl.where(pair == 0, bounds, 0), 0)
            hi = tl.sum(tl.where(pair == 1, bounds, 0), 0)
            accepting = tl.load(arena_ptr + off + HEADER + state)
            row = logits_ptr + tl.cast(r, tl.int64) * stride
            jj = tl.arange(0, CHUNK)
            on = jj < hi - lo  # at most CHUNK edges fall in a chunk of CHUNK ids
            tok = tl.load(arena_ptr + tokens + lo + jj, mask=on, other=0)
            kept = tl.load(row + tok, mask=on)
            ee = tl.arange(0, MAX_EOS)
            eos = tl.load(eos_ptr + ee)
            eos_on = ((ee * 0 + accepting) != 0) & (eos >= c0) & (eos < c0 + CHUNK)  # vector masks only
            eos_kept = tl.load(row + tl.maximum(eos, 0), mask=eos_on)
            tl.debug_barrier()  # every gather is done before the chunk is overwritten
            idx = c0 + jj
            tl.store(row + idx, tl.full([CHUNK], float("-inf"), tl.float32), mask=idx < V)
            tl.debug_barrier()
            tl.store(row + tok, kept, mask=on)
            tl.store(row + tl.maximum(eos, 0), eos_kept, mask=eos_on)
            tl.debug_barrier()  # the next item of this program may be another chunk's


@triton.jit
def _advance_kernel(
    n_rows_ptr, sample_slot_ptr, sampled_ptr, c_offset_ptr, c_state_ptr, arena_ptr, STEPS: tl.constexpr
):
    r = tl.program_id(0)  # one row a program: the binary searches are latency, not work
    if r < tl.load(n_rows_ptr):
        slot = tl.load(sample_slot_ptr + r)
        off = tl.load(c_offset_ptr + tl.maximum(slot, 0))
        if (slot >= 0) & (off >= 0):
            token = tl.load(sampled_ptr + r).to(tl.int32)
            state = tl.load(c_state_ptr + slot)
            first, end, tokens, targets = _edges(arena_ptr, off, state)
            one = tl.arange(0, 1)
            i = tl.sum(_lower_bounds(arena_ptr, tokens, first, end, one * 0 + token, STEPS), 0)
            found = i < end
            if found:
                found = tl.load(arena_ptr + tokens + i) == token
            if found:  # else end of sequence: the request ends, its state no longer matters
                tl.store(c_state_ptr + slot, tl.load(arena_ptr + targets + i))


@triton.jit
def check_constraint(recs, ring_ptr, AREAS: tl.constexpr):
    """A record's token automaton (engine_server._decode_constraint): (words outside the area, a
    header that does not describe its words). Its edges are not checked here (the reference checks
    their tokens and states are in range; the loop's kernels only stay inside the area)."""
    n_words, first = recs.constraint_len, recs.constraint_offset
    outside = (n_words > 0) & ((first < 0) | (first + n_words > AREAS.constraint_words))
    head = (n_words >= 3) & ~outside
    at = AREAS.constraint_at // 4 + first
    ring_i32 = ring_ptr.to(tl.pointer_type(tl.int32))
    n = tl.load(ring_i32 + at, mask=head, other=0, volatile=True)
    initial = tl.load(ring_i32 + at + 1, mask=head, other=0, volatile=True)
    n_edges = tl.load(ring_i32 + at + 2, mask=head, other=0, volatile=True)
    fits = (
        (n >= 1) & (initial >= 0) & (initial < n) & (n_edges >= 0) & (n_words == 3 + 2 * n + 1 + 2 * n_edges)
    )
    return outside, (n_words > 0) & ~outside & ~(head & fits)


@triton.jit
def copy_constraints(r_slot, r_outcome, tk, recs, ring_ptr, slots, AREAS: tl.constexpr, BLOCK_R: tl.constexpr,
                      TILE: tl.constexpr):  # fmt: skip
    """Each admitted record's automaton, from the ring's constraint area into the device's copy at
    the same offset; the slot's c_offset (-1: unconstrained) and c_state (the initial state)."""
    adm = tk & (r_slot >= 0) & (r_outcome == 0)
    has = adm & (recs.constraint_len > 0)
    sl = tl.where(adm, r_slot, 0)
    ring_i32 = ring_ptr.to(tl.pointer_type(tl.int32)) + AREAS.constraint_at // 4
    tl.store(slots.c_offset + sl, tl.where(has, recs.constraint_offset, -1), mask=adm)
    initial = tl.load(ring_i32 + recs.constraint_offset + 1, mask=has, other=0, volatile=True)
    tl.store(slots.c_state + sl, initial, mask=adm)
    offs_r, offs = tl.arange(0, BLOCK_R), tl.arange(0, TILE)
    for i in range(BLOCK_R):
        n = tl.sum(tl.where((offs_r == i) & has, recs.constraint_len, 0), 0)
        first = tl.sum(tl.where((offs_r == i) & has, recs.constraint_offset, 0), 0)
        for w0 in range(0, n, TILE):
            w = first + w0 + offs
            on = w0 + offs < n
            tl.store(slots.constraint_arena + w, tl.load(ring_i32 + w, mask=on, volatile=True), mask=on)


def mask_rows(
    logits, n_rows, sample_slot, c_offset, c_state, arena, eos, *, chunk: int, programs: int, steps: int
) -> None:
    """-inf outside the allowed tokens of each constrained row in [0, n_rows). Capturable."""
    S, V = logits.shape
    n_chunks = triton.cdiv(V, chunk)
    _mask_kernel[(max(1, min(S * n_chunks, programs)),)](
        logits, logits.stride(0), n_rows, sample_slot, c_offset, c_state, arena, eos, V, n_chunks,
        CHUNK=chunk, MAX_EOS=eos.numel(), STEPS=steps, num_warps=4,
    )  # fmt: skip


def advance_rows(n_rows, sample_slot, sampled, c_offset, c_state, arena, *, steps: int) -> None:
    """Each constrained row's slot moves to the state its sampled token leads to. Capturable."""
    _advance_kernel[(sampled.shape[0],)](
        n_rows, sample_slot, sampled, c_offset, c_state, arena, STEPS=steps, num_warps=1
    )
