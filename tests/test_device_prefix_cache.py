"""The prefix cache of the device loop's schedule step (kernels/prefix_cache.py) against the CPU
reference, step by step (tests/scheduler_twin.py): block holders, the LRU of cached blocks, the
cache table, lookups, registrations and evictions, under preemption and cancels.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.state import COUNTER_INDEX  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, RING, prompt  # noqa: E402

CACHED = dataclasses.replace(LOOP, prefix_cache=True)
SHARED = [prompt(12, 11), prompt(9, 12), prompt(16, 13)]  # the prefixes requests share


def shared_prefix_workload(t: Twin, seed: int, steps: int = 50) -> None:
    """Requests that start with one of a few shared prefixes (or none) and a random tail, greedy and
    sampled, three classes, arriving at random; cancels; then run to completion."""
    rng = random.Random(seed)
    live = []
    region = t.front.regions[0]
    for _ in range(steps):
        for _ in range(rng.choice([0, 1, 1, 2])):
            if not any(region.load_ctl(c, "generation") == region.load_progress(c, "done")
                       for c in range(RING.max_inflight)):  # fmt: skip
                break
            head = rng.choice([*SHARED, []])
            p = head[: rng.randint(len(head) // 2, len(head))] + prompt(
                rng.randint(1, 8), rng.randint(0, 999)
            )
            params = rng.choice([
                SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8)),
                SamplingParams(temperature=0.9, top_k=20, seed=rng.randint(0, 99), max_tokens=rng.randint(1, 8)),
            ])  # fmt: skip
            live.append(t.front.submit(p[:28], params, priority=rng.choice([0, 0, 2])))
        if live and rng.random() < 0.06:
            t.front.cancel(live.pop(rng.randrange(len(live))))
        t.step()
    t.run_until_idle(400)
    s = t.state
    assert int(s.num_active) == 0
    assert int(s.free_top) + int(s.lru_words[2]) == t.loop.num_kv_blocks, "every block free or cached"


@pytest.mark.parametrize(("seed", "limit"), [(1, -1), (2, 0), (3, 2)])
def test_prefix_cache_matches_reference_step_by_step(seed, limit):
    """Hits (some on blocks nobody holds, which leave the LRU), registrations, evictions past the
    stack, preemption by the budget fill and by admission: block for block as the reference."""
    loop = dataclasses.replace(CACHED, num_kv_blocks=14, lower_class_limit=limit, max_num_seqs=4)
    t = Twin(loop)
    shared_prefix_workload(t, seed)
    counters = t.state.counters.tolist()
    assert counters[COUNTER_INDEX["prefix_cache_hits"]] > 0, "the workload must hit the cache"
    assert t.stats.preemptions > 0, "and preempt"


def test_an_eviction_reaches_past_the_stack_into_the_lru_in_order():
    """With the stack empty, a new prompt takes cached blocks least recently released first; the
    prompt that used them misses afterwards."""
    t = Twin(dataclasses.replace(CACHED, num_kv_blocks=8, max_model_len=32))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    t.front.submit(prompt(17, 1), greedy)  # 5 blocks; 4 full ones cached at the end
    t.run_until_idle()
    assert int(t.state.lru_words[2]) == 4 and int(t.state.free_top) == 4
    t.front.submit(prompt(17, 1), greedy)  # hits 4 blocks (the last one is fed again)
    t.run_until_idle()
    hits = t.state.counters.tolist()[COUNTER_INDEX["prefix_cache_hits"]]
    assert hits == 16
    t.front.submit(prompt(30, 2), greedy)  # 8 blocks: the stack's 4, then all 4 cached ones
    t.run_until_idle()
    t.front.submit(prompt(17, 1), greedy)
    t.run_until_idle()
    assert t.state.counters.tolist()[COUNTER_INDEX["prefix_cache_hits"]] == hits, "evicted: no hit"


def test_lru_compaction_keeps_the_order():
    """Cached blocks taken again leave dead LRU entries; past half the ring they are squeezed out
    and the live order stays the reference's (the twin compares it every step)."""
    t = Twin(dataclasses.replace(CACHED, num_kv_blocks=8, max_model_len=32))
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    tails_seen = []
    for _ in range(12):  # each round revives 3 cached blocks and releases them again
        t.front.submit(prompt(13, 4), greedy)
        t.run_until_idle()
        head, tail, _ = t.state.lru_words.tolist()
        tails_seen.append(tail - head)
    assert max(tails_seen) <= t.loop.lru_capacity // 2 + 8
    assert min(tails_seen[4:]) < max(tails_seen), "compaction must have run"


def test_a_whole_prompt_in_the_cache_still_feeds_its_last_block():
    """A block-aligned prompt seen before: its last block is computed again (the step that feeds
    the last token samples), the rest comes from the cache."""
    t = Twin(CACHED)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    for _ in range(2):
        t.front.submit(prompt(16, 3), greedy)
        t.run_until_idle()
    assert t.state.counters.tolist()[COUNTER_INDEX["prefix_cache_hits"]] == 12  # 3 of its 4 blocks
