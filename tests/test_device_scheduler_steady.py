"""The schedule's steady decode step (kernels/schedule_steady.py) against its full path on the same
state, every iteration: a second DeviceScheduler built without the steady step gets a copy of
everything a launch reads (device state, forward inputs, scratch, the ring) before each launch, and
afterwards both must hold the same bytes everywhere. The twin compares the steady side with the CPU
reference too (tests/scheduler_twin.py), so the steady step is checked against both.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.scheduler import DeviceScheduler  # noqa: E402
from blink_appliance.engine.loop.state import COUNTER_INDEX, DeviceState  # noqa: E402
from blink_appliance.model.step_inputs import StepInputs  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.scheduler_twin import DEVICE, ENGINE_SEED, Twin, unmap_rings  # noqa: E402, F401 (autouse fixture)
from tests.test_device_prefix_cache import CACHED, shared_prefix_workload  # noqa: E402
from tests.test_device_scheduler import random_workload  # noqa: E402
from tests.twin_front_end import LOOP, RING, prompt  # noqa: E402

STEADY = COUNTER_INDEX["steady_steps"]
NOT_COMPARED = {"step_start_ns"}  # the step's start time is the clock's


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def _inputs(inputs: StepInputs) -> dict[str, torch.Tensor]:
    return {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}


class SteadyTwin(Twin):
    """A twin whose every launch is also run by a scheduler without the steady step, on a copy."""

    def __init__(self, loop=LOOP) -> None:
        super().__init__(loop)
        self.full_state = DeviceState(**_copy(self.state.tensors()))
        self.full_inputs = StepInputs(**_copy(_inputs(self.inputs)))
        self.full_ring = torch.zeros(self.layout.size, dtype=torch.uint8, device=DEVICE)
        self.full_ring.copy_(self.ring[: self.layout.size])
        self.full = DeviceScheduler(
            loop, self.full_state, self.full_ring, self.layout, self.full_inputs, ENGINE_SEED, steady=False
        )
        self.steady = {"steps": 0, "block_pops": 0, "evictions": 0}

    def launch(self) -> None:
        for name, t in self.state.tensors().items():
            getattr(self.full_state, name).copy_(t)
        for name, t in _inputs(self.inputs).items():
            getattr(self.full_inputs, name).copy_(t)
        self.full_ring.copy_(self.ring[: self.layout.size])
        for name in ("scratch", "snap", "bias_stage_ids", "bias_stage_values"):
            getattr(self.full, name).copy_(getattr(self.scheduler, name))
        before = int(self.state.counters[STEADY])
        top, lru_head = int(self.state.free_top), int(self.state.lru_words[0])
        super().launch()
        self.full.launch()
        if int(self.state.counters[STEADY]) > before:
            self.steady["steps"] += 1
            self.steady["block_pops"] += int(self.state.free_top) < top
            self.steady["evictions"] += int(self.state.lru_words[0]) > lru_head
        self._compare_with_full()

    def _compare_with_full(self) -> None:
        counters = self.state.counters.clone()
        counters[STEADY] = self.full_state.counters[STEADY]
        assert torch.equal(counters, self.full_state.counters), "counters"
        for name, t in self.state.tensors().items():
            if name not in NOT_COMPARED | {"counters"}:
                assert torch.equal(t, getattr(self.full_state, name)), f"DeviceState.{name}"
        for name, t in _inputs(self.inputs).items():
            assert torch.equal(t, getattr(self.full_inputs, name)), f"StepInputs.{name}"
        assert torch.equal(self.ring[: self.layout.size], self.full_ring), "the ring"
        # The block-table columns and rows the forward step wrote carry over to the next step; the
        # rest of the scratch is each path's working space within a launch.
        assert torch.equal(self.scheduler.scratch[-3:-1], self.full.scratch[-3:-1]), "scratch words"
        assert torch.equal(self.scheduler.snap, self.full.snap), "snap"


@pytest.mark.parametrize(("seed", "aging"), [(1, 0), (2, 2), (3, 0)])
def test_steady_steps_equal_the_full_path_under_random_traffic(seed, aging):
    """Arrivals, cancels and preemption break steady runs at random; small blocks make decodes pop
    blocks inside them."""
    t = SteadyTwin(dataclasses.replace(LOOP, priority_aging_steps=aging))
    random_workload(t, seed)
    assert t.steady["steps"] > 0 and t.steady["block_pops"] > 0, t.steady


@pytest.mark.parametrize(("seed", "limit", "batch"), [(4, 0, -1), (5, 2, -1), (7, -1, 2), (9, 2, 3)])
def test_steady_steps_equal_the_full_path_with_a_class_cap_and_best_effort_turns(seed, limit, batch):
    """Held sequences keep a step off the steady path (they are live but not in the batch); steady
    runs happen between them, and the cap and the turns must hold nothing there."""
    loop = dataclasses.replace(
        LOOP, max_num_seqs=6, num_kv_blocks=24, lower_class_limit=limit, best_effort_batch=batch
    )
    t = SteadyTwin(loop)
    random_workload(t, seed)
    assert t.steady["steps"] > 0 and t.stats.held > 0, (t.steady, t.stats.held)


@pytest.mark.parametrize("seed", [1, 2])
def test_steady_steps_equal_the_full_path_with_the_prefix_cache(seed):
    """Shared prefixes: hits, registrations and evictions around the steady runs."""
    t = SteadyTwin(dataclasses.replace(CACHED, num_kv_blocks=14, max_num_seqs=4))
    shared_prefix_workload(t, seed)
    assert t.steady["steps"] > 0, t.steady


def test_steady_decodes_evict_cached_blocks_once_the_free_stack_is_empty():
    """Finished requests leave their prompt blocks cached; two long decodes then need more blocks
    than the free stack holds and take the rest from the LRU, inside steady steps."""
    t = SteadyTwin(dataclasses.replace(CACHED, num_kv_blocks=12, max_num_seqs=4))
    for i in range(3):
        t.front.submit(prompt(8, 20 + i), SamplingParams(temperature=0.0, max_tokens=1))
    t.run_until_idle()
    assert int(t.state.lru_words[2]) == 6, "three requests' two prompt blocks each are cached"
    params = SamplingParams(temperature=0.0, max_tokens=RING.max_output_tokens, ignore_eos=True)
    for i in range(2):
        t.front.submit(prompt(4, 30 + i), params)
    t.run_until_idle()
    assert t.steady["evictions"] > 0 and t.steady["block_pops"] > 0, t.steady


def test_long_decodes_take_the_steady_step_until_something_changes():
    """Three requests decoding side by side: after the first decode step every step is steady until
    an arrival, which takes the full path, then steady again."""
    loop = dataclasses.replace(LOOP, num_kv_blocks=40, max_model_len=64)
    t = SteadyTwin(loop)
    params = SamplingParams(temperature=0.0, max_tokens=RING.max_output_tokens, ignore_eos=True)
    for i in range(3):
        t.front.submit(prompt(3 + i, i), params)  # 12 tokens: one prefill step
    t.step()  # admission and prefill
    t.step()  # the first decodes: the step before was a prefill
    for _ in range(8):
        t.step()
    assert t.steady["steps"] == 8, t.steady
    t.front.submit(prompt(4, 9), SamplingParams(temperature=0.7, max_tokens=3, seed=1))
    t.step()
    assert t.steady["steps"] == 8, "an arrival takes the full path"
    t.run_until_idle()
    assert t.steady["steps"] > 8
