"""The KV block free list: ownership invariants under random use, and the documented pop order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_appliance.engine.reference.block_allocator import BlockAllocator


def test_fresh_pool_hands_out_ascending_ids():
    a = BlockAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    assert (a.num_used, a.num_free) == (5, 3)


def test_freed_blocks_come_back_in_block_table_order():
    a = BlockAllocator(8)
    first = a.allocate(3)
    a.allocate(2)
    a.free(first)
    assert a.allocate(3) == first  # LIFO stack, pushed in reverse: same order again
    assert a.allocate(3) == [5, 6, 7]


def test_errors_on_exhaustion_double_free_and_foreign_ids():
    a = BlockAllocator(4)
    blocks = a.allocate(4)
    assert not a.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate(1)
    a.free(blocks[:2])
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free([blocks[0]])
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free([99])
    with pytest.raises(RuntimeError, match="twice"):
        a.free([blocks[2], blocks[2]])
    assert a.num_used == 2  # the failed frees changed nothing
    with pytest.raises(ValueError):
        BlockAllocator(0)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 32),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60),
)
def test_random_use_keeps_ownership_exact(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    owners: list[list[int]] = []  # block lists held by pretend sequences
    for is_alloc, n in ops:
        if is_alloc:
            if a.can_allocate(n):
                owners.append(a.allocate(n))
            else:
                with pytest.raises(RuntimeError):
                    a.allocate(n)
        elif owners:
            a.free(owners.pop(n % len(owners)))
        held = [b for blocks in owners for b in blocks]
        assert len(held) == len(set(held)), "a block is owned twice"
        assert all(0 <= b < num_blocks for b in held)
        assert a.num_used == len(held)
        assert a.num_used + a.num_free == num_blocks
        u = a.usage()
        assert (u.used, u.free, u.total) == (len(held), num_blocks - len(held), num_blocks)
    for blocks in owners:
        a.free(blocks)
    assert a.num_free == num_blocks
    assert sorted(a.allocate(num_blocks)) == list(range(num_blocks))
