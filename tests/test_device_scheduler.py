"""The device loop's schedule step (DeviceScheduler, kernels/schedule.py) against the CPU reference,
step by step (tests/scheduler_twin.py says how): a mixed workload with preemption, priorities.
The other schedule tests: tests/test_device_scheduler_records.py (ring intake, shutdown) and
tests/test_device_scheduler_kernel.py (the launch and the kernel's compilation).
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
from blink_appliance.wire.request import FinishReason, SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import FINISH_CODES  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, RING, prompt  # noqa: E402


def mixed_workload(t: Twin) -> None:
    """Different prompt lengths and priorities, seeded and unseeded sampling, arrivals while decoding,
    a cancel, and a KV cache small enough that running requests get preempted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    t.front.submit(prompt(10, 1), greedy)
    t.front.submit(prompt(5, 2), SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=5))
    t.front.submit(
        prompt(20, 3), SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=4), priority=1
    )
    t.step()
    t.step()
    late = t.front.submit(prompt(7, 4), SamplingParams(temperature=1.0, max_tokens=8))  # unseeded
    t.front.submit(prompt(3, 5), greedy, priority=-1)
    t.step()
    t.front.submit(prompt(14, 6), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    t.step()
    t.step()
    t.front.cancel(late)
    t.step()
    t.front.submit(prompt(25, 7), SamplingParams(temperature=0.0, max_tokens=5), priority=1)
    t.front.submit(prompt(2, 8), greedy)
    t.run_until_idle()
    t.step()  # idle: no forward
    st = t.stats
    assert st.preemptions > 0, "the workload must force preemption"
    assert st.admitted_while_running > 0
    assert st.last_finish(late.channel) == (FINISH_CODES[FinishReason.ABORT], 0), (
        "the cancel must have landed"
    )
    assert int(t.state.free_top) == LOOP.num_kv_blocks and int(t.state.num_active) == 0
    counters = t.state.counters.tolist()
    assert (
        counters[COUNTER_INDEX["steps"]] == st.steps and counters[COUNTER_INDEX["step_tokens"]] == st.tokens
    )
    assert counters[COUNTER_INDEX["loop_iterations"]] == st.iterations > st.steps


@pytest.mark.parametrize("rank_tile", [None, 1])
def test_mixed_workload_matches_reference_step_by_step(rank_tile):
    """rank_tile 1: running sequences are put in run order one tile per sequence, and the block
    tables written a row per tile, as max_seqs beyond the tiles does on the GPU."""
    mixed_workload(Twin(rank_tile=rank_tile))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures the launch in a graph)")
def test_mixed_workload_replayed_from_a_cuda_graph():
    """launch() captured once and replayed: it reads nothing on the host and allocates nothing."""
    mixed_workload(Twin(cuda_graph=True))


def test_an_urgent_request_preempts_the_lowest_class_and_nothing_preempts_within_a_class():
    t = Twin()
    background = [
        t.front.submit(prompt(3, 10 + i), SamplingParams(max_tokens=8, ignore_eos=True), priority=5)
        for i in range(LOOP.max_num_seqs)
    ]
    t.step()
    t.step()
    same = t.front.submit(prompt(4, 20), SamplingParams(max_tokens=2, ignore_eos=True), priority=5)
    t.step()
    assert t.engine.scheduler.num_preemptions == 0, (
        "the slots are full, but within one class nothing preempts"
    )
    urgent = t.front.submit(prompt(4, 21), SamplingParams(max_tokens=2, ignore_eos=True), priority=-3)
    ref = t.step()
    # The last admitted background request (the youngest of the lowest class) makes room.
    assert ref.preempted == [background[-1].request_id]
    assert ref.chunks[-1].request_id == urgent.request_id and ref.chunks[-1].start == 0
    assert t.stats.preempted_for_admission == 1
    assert [q.request_id for q in t.engine.scheduler.running][0] == urgent.request_id
    t.run_until_idle()
    assert t.stats.last_finish(same.channel) == (FINISH_CODES[FinishReason.LENGTH], 0)


def random_workload(t: Twin, seed: int, steps: int = 60) -> None:
    """Requests of three classes arriving at random (prompts of 1-20 tokens, greedy, seeded and
    unseeded sampling, top-k alone and with top-p, so each sampler variant), cancels; then run to completion. The twin compares every step."""
    rng = random.Random(seed)
    live = []
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            if not any(t.front.regions[0].load_ctl(c, "generation") == t.front.regions[0].load_progress(c, "done")
                       for c in range(RING.max_inflight)):  # fmt: skip
                break
            params = rng.choice([
                SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 10)),
                SamplingParams(temperature=0.9, top_k=20, seed=rng.randint(0, 99), max_tokens=rng.randint(1, 10)),
                SamplingParams(temperature=0.7, max_tokens=rng.randint(1, 10), ignore_eos=True),
                SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=rng.randint(1, 10)),
            ])  # fmt: skip
            p = prompt(rng.randint(1, 20), rng.randint(0, 999))
            live.append(t.front.submit(p, params, priority=rng.choice([-2, 0, 0, 3, 3])))
        if live and rng.random() < 0.05:
            t.front.cancel(live.pop(rng.randrange(len(live))))
        t.step()
    t.run_until_idle(400)
    assert int(t.state.free_top) == t.loop.num_kv_blocks and int(t.state.num_active) == 0


@pytest.mark.parametrize("aging", [0, 2])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_mixed_priority_workloads_match_reference_step_by_step(seed, aging):
    """Preemption by the budget fill and by admission, with and without aging, chunk for chunk."""
    t = Twin(dataclasses.replace(LOOP, priority_aging_steps=aging))
    random_workload(t, seed)
    assert t.stats.preempted_for_admission > 0 and t.stats.preemptions > t.stats.preempted_for_admission
    assert t.stats.held == 0


@pytest.mark.parametrize("limit", [-1, 0, 2])
@pytest.mark.parametrize(("seed", "aging"), [(4, 0), (5, 2), (6, 0)])
def test_random_workloads_with_a_class_cap_match_reference_step_by_step(seed, aging, limit):
    """lower_class_limit: the class cap's held sequences (phase 0) and its hold on admission, chunk
    for chunk. Six sequences a step and blocks for them, so that one of the top class and three below
    exceed a cap of two."""
    loop = dataclasses.replace(
        LOOP, max_num_seqs=6, num_kv_blocks=24, priority_aging_steps=aging, lower_class_limit=limit
    )
    t = Twin(loop)
    random_workload(t, seed)
    assert (t.stats.held > 0) == (limit >= 0), "the cap must have held sequences (and only with one)"


@pytest.mark.parametrize(("seed", "limit", "batch"), [(7, -1, 2), (8, 0, 1), (9, 2, 3)])
def test_random_workloads_with_best_effort_turns_match_reference_step_by_step(seed, limit, batch):
    """best_effort_batch: best-effort sequences (class >= 1 here: priority 3) step in a window that
    moves every step, alone and beside the class cap, chunk for chunk."""
    loop = dataclasses.replace(
        LOOP, max_num_seqs=6, num_kv_blocks=24, lower_class_limit=limit, best_effort_batch=batch
    )
    t = Twin(loop)
    random_workload(t, seed)
    assert t.stats.held > 0
