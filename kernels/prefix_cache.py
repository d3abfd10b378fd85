"""KV block references and the prefix cache on the device: the GPU side of the reference
BlockAllocator (docs/engine.md, "The KV block free list" and "Prefix cache"), for schedule and commit.

The blocks' state is BlockTensors (DeviceState): each block's holders (`ref`), whether it is
registered in the cache (`cached`) and under which hash (`key`, 4 int32 words), the direct-mapped
`table` (entry -> block, -1 empty; entry = the hash's low bits), and the LRU order of the cached
blocks nobody holds. That order is a ring `lru[Q]` of block ids between absolute positions head and
tail, with each block's latest position in `lru_pos`. An entry is live while its block has no
holder, is still cached, and the entry is its latest: acquiring a cached block leaves a dead entry
behind, which eviction skips and `compact_lru` squeezes out before the ring fills.

Scalars (the stack top, the LRU's head, tail and live count) are loaded once per program and
stored once at its end by the caller (kernels/schedule.py's docstring says why), so these helpers
take them and return them. A block is moved by one thread, and another warp may read it next:
the helpers put a CTA barrier between dependent passes.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2**31 - 1)


class BlockTensors(NamedTuple):
    """DeviceState's KV block tensors (engine/loop/state.py says what each holds)."""

    ref: tl.tensor
    cached: tl.tensor
    key: tl.tensor
    table: tl.tensor
    lru: tl.tensor
    lru_pos: tl.tensor
    evicted: tl.tensor  # scratch: the blocks one take_blocks evicts, in LRU order


@triton.jit
def _lru_live(p, tail, blocks, Q: tl.constexpr):
    """The block of each LRU position and whether the entry is live."""
    inq = p < tail
    b = tl.load(blocks.lru + p % Q, mask=inq, other=0)
    live = inq & (tl.load(blocks.ref + b, mask=inq, other=1) == 0)
    live = live & (tl.load(blocks.cached + b, mask=inq, other=0) != 0)
    return b, live & (tl.load(blocks.lru_pos + b, mask=inq, other=-1) == p)


@triton.jit
def release_one(slot, count, top, tail, n_cached, block_table_ptr, free_blocks_ptr, blocks,
                MAXB: tl.constexpr, BLOCK_J: tl.constexpr, Q: tl.constexpr):  # fmt: skip
    """One slot lets go of the first `count` blocks of its table, the table reversed: each loses a
    holder; one left with none goes on the stack, or to the LRU's tail when cached. The table
    entries become -1. Returns (top, tail, n_cached)."""
    jj = tl.arange(0, BLOCK_J)
    for j0 in range(0, count, BLOCK_J):
        j = j0 + jj
        m = j < count
        entry = block_table_ptr + slot * MAXB + (count - 1 - j)
        b = tl.load(entry, mask=m, other=0)
        left = tl.load(blocks.ref + b, mask=m, other=1) - 1
        cached = tl.load(blocks.cached + b, mask=m, other=0) != 0
        # Every warp has read the entries and holder counts before the stores below: at BLOCK_J
        # lanes the sums hold no barrier, and a warp reading late would see -1 or the new count.
        tl.debug_barrier()
        tl.store(blocks.ref + b, left, mask=m)
        to_stack = (m & (left == 0) & ~cached).to(tl.int32)
        to_lru = (m & (left == 0) & cached).to(tl.int32)
        tl.store(free_blocks_ptr + top + tl.cumsum(to_stack, 0) - to_stack, b, mask=to_stack != 0)
        at = tail + (tl.cumsum(to_lru, 0) - to_lru).to(tl.int64)
        tl.store(blocks.lru + at % Q, b, mask=to_lru != 0)
        tl.store(blocks.lru_pos + b, at, mask=to_lru != 0)
        tl.store(entry, tl.full(b.shape, -1, tl.int32), mask=m)
        top += tl.sum(to_stack, 0)
        tail += tl.sum(to_lru, 0).to(tl.int64)
        n_cached += tl.sum(to_lru, 0)
    return top, tail, n_cached


@triton.jit
def release_lanes(release, lane, slot, count, top, tail, n_cached, block_table_ptr, free_blocks_ptr, blocks,
                  MAXB: tl.constexpr, BLOCK_J: tl.constexpr, Q: tl.constexpr):  # fmt: skip
    """release_one for each lane in `release`, one after the other in lane order, as the reference
    frees sequences one by one. Returns (top, tail, n_cached)."""
    remaining = release
    for _ in range(0, tl.sum(release.to(tl.int32), 0)):
        first = lane == tl.min(tl.where(remaining, lane, _INT32_MAX), 0)
        s = tl.sum(tl.where(first, slot, 0), 0)
        c = tl.sum(tl.where(first, count, 0), 0)
        tl.debug_barrier()  # the previous one's holders and stack entries are visible
        top, tail, n_cached = release_one(s, c, top, tail, n_cached, block_table_ptr, free_blocks_ptr, blocks,
                                          MAXB, BLOCK_J, Q)  # fmt: skip
        remaining = remaining & ~first
    tl.debug_barrier()
    return top, tail, n_cached


@triton.jit
def evict_lru(k, head, tail, blocks, C: tl.constexpr, Q: tl.constexpr, BLOCK_L: tl.constexpr):
    """Evict the first k live LRU entries into blocks.evicted[0, k): out of the cache, head past
    them. Returns the new head."""
    taken = tl.full([], 0, tl.int32)
    while (taken < k) & (head < tail):
        p = head + tl.arange(0, BLOCK_L).to(tl.int64)
        b, live = _lru_live(p, tail, blocks, Q)
        live_i = live.to(tl.int32)
        rank = taken + tl.cumsum(live_i, 0) - live_i
        out = live & (rank < k)
        tl.store(blocks.evicted + rank, b, mask=out)
        w0 = tl.load(blocks.key + 4 * b, mask=out, other=0)
        tl.store(blocks.table + (w0 & (C - 1)), tl.full(b.shape, -1, tl.int32), mask=out)
        tl.store(blocks.cached + b, tl.zeros_like(b), mask=out)
        taken += tl.sum(out.to(tl.int32), 0)
        head = tl.where(taken >= k, tl.max(tl.where(out, p, -1), 0) + 1, tl.minimum(head + BLOCK_L, tail))
    tl.debug_barrier()
    return head


@triton.jit
def take_blocks(take, count, offset, slot, num_blocks, top, head, tail, n_cached, block_table_ptr,
                free_blocks_ptr, blocks, MAXB: tl.constexpr, BLOCK_J: tl.constexpr, C: tl.constexpr,
                Q: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    """Hand each taking lane `count` blocks, appended to its table after `num_blocks` entries: its
    j-th is the (offset + j)-th free block, counting the stack from its top and then the LRU from
    its head (those are evicted). Each one taken has one holder. Returns (top, head, n_cached)."""
    total = tl.sum(tl.where(take, count, 0), 0)
    if total > top:
        head = evict_lru(total - top, head, tail, blocks, C, Q, BLOCK_L)
        n_cached -= total - top
    count = tl.where(take, count, 0)
    jj = tl.arange(0, BLOCK_J)
    for j0 in range(0, tl.max(count, 0), BLOCK_J):
        j = j0 + jj
        m = j[None, :] < count[:, None]
        at = top - 1 - offset[:, None] - j[None, :]
        b = tl.where(
            at >= 0,
            tl.load(free_blocks_ptr + at, mask=m & (at >= 0), other=-1),
            tl.load(blocks.evicted + (-1 - at), mask=m & (at < 0), other=-1),
        )
        tl.store(block_table_ptr + slot[:, None] * MAXB + num_blocks[:, None] + j[None, :], b, mask=m)
        tl.store(blocks.ref + b, tl.full(b.shape, 1, tl.int32), mask=m)
    tl.debug_barrier()
    return tl.maximum(top - total, 0), head, n_cached


@triton.jit
def open_lru(lru_words_ptr, blocks, Q: tl.constexpr, BLOCK_L: tl.constexpr):
    """The LRU's words at a program's start (head, tail, live count), its dead entries squeezed out
    first once they fill half the ring."""
    head = tl.load(lru_words_ptr)
    tail = tl.load(lru_words_ptr + 1)
    if tail - head > Q // 2:
        tail = compact_lru(head, tail, blocks, Q, BLOCK_L)
    return head, tail, tl.load(lru_words_ptr + 2).to(tl.int32)


@triton.jit
def close_lru(lru_words_ptr, head, tail, n_cached):
    """The LRU's words at a program's end (after its last barrier)."""
    tl.store(lru_words_ptr, head)
    tl.store(lru_words_ptr + 1, tail)
    tl.store(lru_words_ptr + 2, n_cached.to(tl.int64))


@triton.jit
def compact_lru(head, tail, blocks, Q: tl.constexpr, BLOCK_L: tl.constexpr):
    """Squeeze the dead entries out of [head, tail), keeping the live ones in order. Returns the
    new tail."""
    new_tail = head
    for p0 in range(head, tail, BLOCK_L):
        p = p0 + tl.arange(0, BLOCK_L).to(tl.int64)
        b, live = _lru_live(p, tail, blocks, Q)
        live_i = live.to(tl.int64)
        at = new_tail + tl.cumsum(live_i, 0) - live_i
        tl.debug_barrier()  # the tile is read before entries move down onto it
        tl.store(blocks.lru + at % Q, b, mask=live)
        tl.store(blocks.lru_pos + b, at, mask=live)
        new_tail += tl.sum(live_i, 0)
        tl.debug_barrier()
    return new_tail


@triton.jit
def _hash_words(hash_ptr, j, m):
    """The 4 words of hash j (a [BLOCK_J] vector of indices) at hash_ptr."""
    w0 = tl.load(hash_ptr + 4 * j, mask=m, other=0)
    w1 = tl.load(hash_ptr + 4 * j + 1, mask=m, other=0)
    w2 = tl.load(hash_ptr + 4 * j + 2, mask=m, other=0)
    w3 = tl.load(hash_ptr + 4 * j + 3, mask=m, other=0)
    return w0, w1, w2, w3


@triton.jit
def _cached_block(hash_ptr, j, m, blocks, C: tl.constexpr):
    """The block cached under hash j, and whether there is one."""
    w0, w1, w2, w3 = _hash_words(hash_ptr, j, m)
    b = tl.load(blocks.table + (w0 & (C - 1)), mask=m, other=-1)
    ok = m & (b >= 0)
    ok = ok & (tl.load(blocks.key + 4 * b, mask=ok, other=0) == w0)
    ok = ok & (tl.load(blocks.key + 4 * b + 1, mask=ok, other=0) == w1)
    ok = ok & (tl.load(blocks.key + 4 * b + 2, mask=ok, other=0) == w2)
    ok = ok & (tl.load(blocks.key + 4 * b + 3, mask=ok, other=0) == w3)
    return b, ok


@triton.jit
def lookup_prefix(hash_ptr, limit, blocks, C: tl.constexpr, BLOCK_J: tl.constexpr):
    """BlockAllocator.lookup over hashes [0, limit) at hash_ptr: how many lead with a cached block,
    and how many of those nobody holds (BlockAllocator.revived)."""
    hits = tl.full([], 0, tl.int32)
    revived = tl.full([], 0, tl.int32)
    j0 = tl.full([], 0, tl.int32)
    go = limit > 0
    while go:
        j = j0 + tl.arange(0, BLOCK_J)
        m = j < limit
        b, ok = _cached_block(hash_ptr, j, m, blocks, C)
        miss = tl.min(tl.where(m & ~ok, j, _INT32_MAX), 0)
        run = ok & (j < miss)
        hits += tl.sum(run.to(tl.int32), 0)
        revived += tl.sum((run & (tl.load(blocks.ref + b, mask=run, other=1) == 0)).to(tl.int32), 0)
        j0 += BLOCK_J
        go = (miss == _INT32_MAX) & (j0 < limit)
    return hits, revived


@triton.jit
def acquire_prefix(hash_ptr, hits, slot, block_table_ptr, blocks, MAXB: tl.constexpr, C: tl.constexpr,
                   BLOCK_J: tl.constexpr):  # fmt: skip
    """The slot takes hold of its `hits` cached blocks (lookup_prefix's): they start its table."""
    for j0 in range(0, hits, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        m = j < hits
        b, _ = _cached_block(hash_ptr, j, m, blocks, C)
        tl.store(blocks.ref + b, tl.load(blocks.ref + b, mask=m, other=0) + 1, mask=m)
        tl.store(block_table_ptr + slot * MAXB + j, b, mask=m)
    tl.debug_barrier()


@triton.jit
def register_filled(nseq, step_slot_ptr, step_chunk_ptr, context_lens_ptr, n_hashes_ptr, hashes_ptr,
                    block_table_ptr, blocks, BS: tl.constexpr, MAXB: tl.constexpr, C: tl.constexpr,
                    HSTRIDE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
    """Scheduler._register_filled: in batch order, each sequence's chunk registers the blocks it
    fills below its number of hashes, each into its table entry if that is empty (within one tile,
    the first of several blocks for one entry)."""
    offs_s = tl.arange(0, BLOCK_S)
    in_b = offs_s < nseq
    slot = tl.load(step_slot_ptr + offs_s, mask=in_b, other=0)
    end = tl.load(context_lens_ptr + offs_s, mask=in_b, other=0)
    lo = (end - tl.load(step_chunk_ptr + offs_s, mask=in_b, other=0)) // BS
    hi = tl.minimum(end // BS, tl.load(n_hashes_ptr + slot, mask=in_b, other=0))
    todo = in_b & (hi > lo)
    jj = tl.arange(0, BLOCK_J)
    earlier = jj[None, :] < jj[:, None]
    for _ in range(0, tl.sum(todo.to(tl.int32), 0)):
        first = offs_s == tl.min(tl.where(todo, offs_s, BLOCK_S), 0)
        s = tl.sum(tl.where(first, slot, 0), 0)
        j_lo = tl.sum(tl.where(first, lo, 0), 0)
        j_hi = tl.sum(tl.where(first, hi, 0), 0)
        for j0 in range(j_lo, j_hi, BLOCK_J):
            j = j0 + jj
            m = j < j_hi
            w0, w1, w2, w3 = _hash_words(hashes_ptr + s * HSTRIDE, j, m)
            b = tl.load(block_table_ptr + s * MAXB + j, mask=m, other=0)
            entry = w0 & (C - 1)
            empty = m & (tl.load(blocks.table + entry, mask=m, other=0) == -1)
            same = (entry[:, None] == entry[None, :]) & m[None, :] & earlier
            reg = empty & (tl.sum(same.to(tl.int32), 1) == 0)
            tl.store(blocks.table + entry, b, mask=reg)
            tl.store(blocks.cached + b, tl.full(b.shape, 1, tl.int32), mask=reg)
            tl.store(blocks.key + 4 * b, w0, mask=reg)
            tl.store(blocks.key + 4 * b + 1, w1, mask=reg)
            tl.store(blocks.key + 4 * b + 2, w2, mask=reg)
            tl.store(blocks.key + 4 * b + 3, w3, mask=reg)
            tl.debug_barrier()
        todo = todo & ~first
