"""The KV block free stack (DeviceState.free_blocks[0, free_top)) of schedule and commit: pushes and
pops of whole rows of slots at once, in the reference BlockAllocator's order.

The stack top is not read or written here: each program loads free_top once and stores it once at
the end (kernels/schedule.py's docstring says why); these helpers take it and the caller keeps it up
to date. Every loop runs to the longest table it moves, not to max_blocks_per_seq, so a step's cost
follows the blocks it moves rather than max_model_len.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def push_blocks(
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
def push_blocks_each(
    release, count, base, slot, lane, block_table_ptr, free_blocks_ptr, MAXB: tl.constexpr, BLOCK_J: tl.constexpr
):  # fmt: skip
    """push_blocks for a vector of many lanes of which few release (a slot-wide vector): one
    releasing lane after the other, in lane order, with [BLOCK_J] tiles. The [lanes x BLOCK_J] tile of
    push_blocks over 4096 slots took ptxas minutes to compile (bench/compile_time.py)."""
    count = tl.where(release, count, 0)
    jj = tl.arange(0, BLOCK_J)
    remaining = release
    for _ in range(0, tl.sum(release.to(tl.int32), 0)):
        first = lane == tl.min(tl.where(remaining, lane, 2**31 - 1), 0)
        s = tl.sum(tl.where(first, slot, 0), 0)
        c = tl.sum(tl.where(first, count, 0), 0)
        b = tl.sum(tl.where(first, base, 0), 0)
        for j0 in range(0, c, BLOCK_J):
            j = j0 + jj
            m = j < c
            entry = block_table_ptr + s * MAXB + (c - 1 - j)
            blocks = tl.load(entry, mask=m, other=-1)
            tl.store(free_blocks_ptr + b + j, blocks, mask=m)
            tl.store(entry, tl.full(blocks.shape, -1, tl.int32), mask=m)
        remaining = remaining & ~first


@triton.jit
def pop_blocks(
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
def release_slots(release, num_blocks, top, offs, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J):
    """Release all blocks of the slots in `release`, in slot order; returns the new stack top."""
    count = tl.where(release, num_blocks, 0)
    base = top + tl.cumsum(count, 0) - count
    push_blocks(release, count, base, offs, block_table_ptr, free_blocks_ptr, MAXB, BLOCK_J)
    return top + tl.sum(count, 0)
