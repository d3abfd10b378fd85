"""The device loop's schedule step (DeviceScheduler, kernels/schedule.py) against the CPU reference,
step by step (tests/scheduler_twin.py says how): a mixed workload with preemption, priorities.
The other schedule tests: tests/test_device_scheduler_records.py (ring intake, shutdown) and
tests/test_device_scheduler_kernel.py (the launch and the kernel's compilation).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.state import COUNTER_INDEX  # noqa: E402
from blink_appliance.wire.request import FinishReason, SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import FINISH_CODES  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, prompt  # noqa: E402


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
    """rank_tile 1: running sequences are put in run order one tile per sequence, as max_seqs
    beyond the tile does on the GPU."""
    mixed_workload(Twin(rank_tile=rank_tile))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures the launch in a graph)")
def test_mixed_workload_replayed_from_a_cuda_graph():
    """launch() captured once and replayed: it reads nothing on the host and allocates nothing."""
    mixed_workload(Twin(cuda_graph=True))


def test_priority_beats_arrival_but_never_preempts():
    t = Twin()
    subs = [
        t.front.submit(prompt(3, 10 + i), SamplingParams(temperature=0.0, max_tokens=3 + i))
        for i in range(LOOP.max_num_seqs + 1)  # one more than fits in a step: the last one waits
    ]
    t.step()
    low = t.front.submit(prompt(4, 20), SamplingParams(temperature=0.0, max_tokens=2), priority=5)
    urgent = t.front.submit(prompt(4, 21), SamplingParams(temperature=0.0, max_tokens=2), priority=-3)
    order: list[int] = []
    for _ in range(12):
        ref = t.step()
        order += [c.request_id for c in ref.chunks if c.start == 0 and c.request_id not in order]
    # The urgent one overtakes the earlier waiting one once a sequence finishes; nothing is preempted.
    assert order.index(urgent.request_id) < order.index(subs[-1].request_id) < order.index(low.request_id)
    assert t.engine.scheduler.num_preemptions == 0
    t.run_until_idle()
