"""The prefix cache of the CPU reference engine (docs/engine.md, "Prefix cache"): the allocator's
rules, hit accounting, and greedy outputs with the cache equal to those without it, under
preemption and cancels."""

from __future__ import annotations

import random

import numpy as np
import pytest

from blink_appliance.engine.reference.block_allocator import BlockAllocator
from blink_appliance.wire.prefix_hash import block_hashes, cache_table_size, hash_values, prompt_words
from blink_appliance.wire.request import Request, SamplingParams
from tests.test_engine import GREEDY, engine

BS = 4


def hashes(tokens: list[int], block_size: int = BS) -> tuple[int, ...]:
    return tuple(hash_values(block_hashes(tokens, block_size)))


def request(rid: int, tokens: list[int], params: SamplingParams = GREEDY, **kw) -> Request:
    return Request(rid, tokens, params, block_hashes=hashes(tokens), **kw)


def test_block_hashes_chain_over_the_whole_prefix():
    a = list(range(3, 20))
    b = a[:4] + [99] + a[5:]
    ha, hb = hashes(a), hashes(b)
    assert len(ha) == len(a) // BS == 4 and len(set(ha)) == 4
    assert ha[0] == hashes(a[:4])[0]  # a block's hash depends on its prefix only
    assert hb[0] == ha[0]  # the change is in block 1
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))  # a change reaches every later block
    assert ha[:2] == hashes(a[:9])  # ... and never an earlier one
    assert hashes([1, 2, 3]) == () and block_hashes([1, 2, 3], BS).size == 0
    assert prompt_words(9, BS) == 9 + 4 * 2 and prompt_words(9, 0) == 9


def test_allocator_lru_eviction_after_the_stack_and_refcounts():
    a = BlockAllocator(6)
    assert a.table_size == cache_table_size(6) == 16
    x = a.allocate(3)  # [0, 1, 2]
    for b, key in zip(x, (100, 101, 102), strict=True):
        assert a.register(b, key)
    y = a.allocate(2)  # [3, 4]
    a.free(y)  # uncached: back on the stack, in table order
    a.free(x)  # cached: the table's tail first in LRU order
    assert (a.num_free, a.num_cached, a.num_used) == (6, 3, 0)
    assert a.lookup([100, 101, 102, 103], 4) == [0, 1, 2]
    assert a.lookup([100, 101, 102], 2) == [0, 1]
    hit = a.lookup([100], 1)
    assert a.revived(hit) == 1
    a.acquire(hit)
    assert (a.num_free, a.num_cached, a.num_used) == (5, 2, 1)
    # The stack first (3, 4, 5), then the cached ones least recently released: 2 was released first.
    assert a.allocate(5) == [3, 4, 5, 2, 1]
    assert a.lookup([100, 101], 2) == [0]  # 1 was evicted
    assert not a.can_allocate(1)
    a.acquire(hit)  # a second holder
    a.free(hit)
    assert a.num_cached == 0 and a.num_used == 6
    a.free(hit)
    assert a.num_cached == 1 and a.lookup([100], 1) == [0]


def test_allocator_keeps_the_first_block_of_a_table_entry_and_refuses_bad_use():
    a = BlockAllocator(4)
    b0, b1 = a.allocate(2)
    assert a.register(b0, 7)
    assert not a.register(b1, 7)  # the same hash again: the first stays, the second is not cached
    assert not a.register(b1, 7 + a.table_size)  # another hash, the same entry: not cached
    assert a.lookup([7 + a.table_size], 1) == []
    with pytest.raises(RuntimeError, match="registered twice"):
        a.register(b0, 9)
    with pytest.raises(RuntimeError, match="not cached"):
        a.acquire([b1])
    a.free([b0, b1])
    with pytest.raises(RuntimeError, match="freed but not allocated"):
        a.free([b0])
    assert a.allocate(4)[:2] == [b1, 2]  # b1 was empty: the stack; b0 was cached: evicted last


SYSTEM = [(i * 7) % 400 + 3 for i in range(21)]  # 5 full blocks and one token


def conversation(rid: int, turn_len: int) -> list[int]:
    return SYSTEM + [(rid * 13 + i * 5) % 400 + 3 for i in range(turn_len)]


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change():
    prompts = [conversation(i, 3 + 2 * i) for i in range(6)]
    off = engine(block_size=BS)
    want = {i: off.generate([request(i, p)])[i] for i, p in enumerate(prompts)}
    on = engine(block_size=BS, prefix_cache=True)
    got = {}
    for i, p in enumerate(prompts):
        got.update(on.generate([request(i, p)]))
    assert got == want
    stats = on.stats()
    # The first one misses; each later one finds the 5 blocks of SYSTEM (its 6th block differs).
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 5 * 5 * BS
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    assert off.stats().prefix_cache_queries == 0 and off.stats().kv_blocks_cached == 0


def test_a_whole_prompt_in_the_cache_still_feeds_its_last_token():
    prompt = SYSTEM[:20]  # exactly 5 blocks
    e = engine(block_size=BS, prefix_cache=True)
    first = e.generate([request(0, prompt)])[0]
    assert e.generate([request(1, prompt)])[1] == first
    assert e.stats().prefix_cache_hits == 4 * BS  # the last block is computed again


def test_prompt_logprobs_look_nothing_up():
    e = engine(block_size=BS, prefix_cache=True)
    e.generate([request(0, SYSTEM)])
    asks = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=True)
    e.generate([request(1, SYSTEM, asks)])
    assert e.stats().prefix_cache_hits == 0


def test_hashes_beyond_the_full_blocks_are_refused():
    e = engine(block_size=BS, prefix_cache=True)
    with pytest.raises(ValueError, match="block_hashes"):
        e.add_request(Request(0, [5, 6, 7], GREEDY, block_hashes=(1,)))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_the_cache_equals_without_under_preemption_and_cancels(seed):
    """Few blocks (preemption by recompute, cached blocks evicted), shared prefixes, and cancels at
    random steps: every request that is not cancelled streams what it streams without the cache,
    the cancelled ones end with one ABORT, and all blocks come back."""
    rng = random.Random(seed)
    prompts = [
        SYSTEM[: rng.choice((0, 8, 12, 21))] + conversation(rng.randrange(3), rng.randrange(1, 12))
        for _ in range(10)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 20), ignore_eos=True)
    cancel_at = {rid: rng.randrange(1, 12) for rid in rng.sample(range(10), 3)}

    def run(prefix_cache: bool) -> tuple[dict[int, list[int]], dict[int, list], object]:
        e = engine(
            block_size=BS,
            num_kv_blocks=24,
            max_model_len=64,
            max_num_batched_tokens=32,
            prefix_cache=prefix_cache,
        )
        for rid, p in enumerate(prompts):
            e.add_request(request(rid, p, params))
        tokens: dict[int, list[int]] = {rid: [] for rid in range(10)}
        ends: dict[int, list] = {rid: [] for rid in range(10)}
        step = 0
        while e.has_unfinished():
            step += 1
            for rid, at in cancel_at.items():
                if at == step:
                    e.abort(rid)
            for ev in e.step():
                if ev.token_id is not None:
                    tokens[ev.request_id].append(ev.token_id)
                if ev.finished:
                    ends[ev.request_id].append(ev.finish_reason)
        return tokens, ends, e.stats()

    want, want_ends, _ = run(False)
    got, ends, stats = run(True)
    assert all(len(v) == 1 for v in ends.values())  # one terminal event each
    for rid in range(10):
        if rid in cancel_at:  # the cache changes how far it got before the cancel, not what it says
            assert got[rid] == want[rid][: len(got[rid])], rid
        else:
            assert (got[rid], ends[rid]) == (want[rid], want_ends[rid]), rid
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0


def test_block_hashes_arena_words_round_trip():
    words = block_hashes(np.arange(3, 40), BS)
    assert words.dtype == np.dtype("<i4") and words.size == 4 * (37 // BS)
    assert hash_values(words) == list(hashes(list(range(3, 40))))
    assert all(0 <= h < 2**128 for h in hash_values(words))
