"""The commit kernel (kernels/commit.py via engine/loop/commit.py) over a real shared ring region.

The kernel writes into a tensor over the same bytes a RingRegion reads (the front end's view), so the
checks read back what a front end would see. Without a GPU it runs under Triton's interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.commit import commit_kernel  # noqa: E402

from blink_appliance.engine.loop.commit import DeviceCommit  # noqa: E402
from blink_appliance.engine.loop.state import (  # noqa: E402
    COUNTER_INDEX,
    DeviceState,
    LoopGeometry,
    SlotState,
)
from blink_appliance.wire.region import RingRegion  # noqa: E402
from blink_appliance.wire.ring_layout import (  # noqa: E402
    FINAL_BIT,
    STEP_TIME_BOUNDS_US,
    ErrorCode,
    RingGeometry,
    RingLayout,
    step_time_bucket,
)
from tests.ring_support import shm_region  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU region tensor; the GPU maps it (B1)")

EOS = 2
RING = RingGeometry(
    request_slots=8,
    arena_tokens=256,
    max_prompt_tokens=64,
    max_inflight=16,
    max_output_tokens=8,
    max_stop_ids=3,
)
GEOMETRY = LoopGeometry(
    num_slots=10, max_num_seqs=8, max_num_batched_tokens=16, buckets=(8, 16), block_size=4, num_kv_blocks=24,
    max_model_len=12, max_stop_ids=3, vocab_size=100, eos_token_ids=(EOS, 99),
)  # fmt: skip


def region_tensor(transport) -> torch.Tensor:
    """The region's bytes as a CPU tensor (the CPU counterpart of MappedRegion.tensor)."""
    return torch.frombuffer(transport.buffer, dtype=torch.uint8)


def admit(state: DeviceState, slot: int, *, chan: int, prompt: list[int], generated: list[int], blocks: list[int],
          max_tokens: int = 8, stop_ids: tuple[int, ...] = (), ignore_eos: bool = False,
          status: SlotState = SlotState.RUNNING) -> None:  # fmt: skip
    """Slot contents as schedule leaves them; the blocks are taken off the free stack by hand."""
    tokens = prompt + generated
    state.slot_state[slot] = status
    state.chan[slot] = chan
    state.generation[slot] = 100 + chan
    state.prompt_len[slot] = len(prompt)
    state.num_tokens[slot] = len(tokens)
    state.token_ids[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    state.max_tokens[slot] = max_tokens
    state.n_stop[slot] = len(stop_ids)
    state.stop_ids[slot, : len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.int32)
    state.ignore_eos[slot] = int(ignore_eos)
    state.block_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    state.num_blocks[slot] = len(blocks)
    state.num_active[0] += 1


def claim(region: RingRegion, chan: int, published: int = 0) -> None:
    """The front end's claim of channel `chan` for generation 100 + chan, `published` tokens already out."""
    region.store_ctl(chan, "generation", 100 + chan)
    region.store_progress(chan, "count", published)


def take_blocks(state: DeviceState, n: int) -> list[int]:
    top = int(state.free_top[0])
    blocks = state.free_blocks[top - n : top].flip(0).tolist()
    state.free_top[0] = top - n
    state.block_ref[blocks] = 1  # one holder each, as schedule's pops leave them
    return blocks


def test_commit_appends_publishes_stops_and_releases():
    with shm_region(RING) as transport:
        region = RingRegion.attach(transport, RING)
        state = DeviceState.allocate(GEOMETRY, "cpu")
        commit = DeviceCommit(GEOMETRY, state, region_tensor(transport), RingLayout.of(RING))
        rows = {}  # sample row -> (slot, token)

        def add(slot, row, token, **kw):
            chan = kw.pop("chan", slot + 3)
            claim(region, chan, published=len(kw["generated"]))
            admit(state, slot, chan=chan, **kw)
            if row is not None:
                state.sample_slot[row] = slot
                state.sampled[row] = token
                rows[row] = (slot, token)

        add(0, 0, 41, prompt=[5, 6, 7], generated=[9], blocks=take_blocks(state, 1))  # goes on
        add(1, 1, 42, prompt=[5], generated=[1, 1], blocks=take_blocks(state, 1), max_tokens=3)  # LENGTH
        eos_blocks = take_blocks(state, 2)
        add(2, 3, EOS, prompt=[8, 8, 8, 8, 8], generated=[], blocks=eos_blocks)  # STOP (EOS)
        add(3, 4, EOS, prompt=[1], generated=[], blocks=take_blocks(state, 1), ignore_eos=True)  # goes on
        add(4, 5, 77, prompt=[1, 2], generated=[3], blocks=take_blocks(state, 1), stop_ids=(50, 77))  # STOP
        add(
            5, 6, 99, prompt=[4], generated=[], blocks=take_blocks(state, 1), max_tokens=1
        )  # EOS beats LENGTH
        add(
            6, 7, 13, prompt=[3] * 11, generated=[], blocks=take_blocks(state, 3), max_tokens=8
        )  # max_model_len
        cancel_blocks = take_blocks(state, 2)
        add(7, None, 0, prompt=[1, 1], generated=[4, 4], blocks=cancel_blocks, status=SlotState.FINISHING)
        state.finish_reason[7], state.error_code[7] = 3, 0  # ABORT (client cancel)
        add(8, None, 0, prompt=[1], generated=[], blocks=[], status=SlotState.FINISHING)
        state.finish_reason[8], state.error_code[8] = 4, int(ErrorCode.STOP_IDS)  # a rejected record
        state.sample_slot[2] = -1  # an unused row in the middle
        top_before = int(state.free_top[0])

        commit.launch()

        prog = region.progress_table()
        tokens_of = {slot: tok for slot, tok in rows.values()}
        for slot, token in tokens_of.items():
            chan = slot + 3
            i = int(state.num_tokens[slot]) - int(state.prompt_len[slot]) - 1  # the appended token's index
            out, times = region.read_output(chan, i, i + 1)
            assert int(out[0]) == token and int(times[0]) > 0, slot
        count = {slot: int(prog["count"][slot + 3]) for slot in range(9)}
        done = {slot: int(prog["done"][slot + 3]) for slot in range(9)}
        assert count[0] == 2 and done[0] == 0  # token #1 of slot 0, not final
        assert count[3] == 1 and done[3] == 0  # EOS ignored
        for slot, n in ((1, 3), (2, 1), (4, 2), (5, 1), (6, 1)):
            assert count[slot] == n | FINAL_BIT and done[slot] == 100 + slot + 3, slot
        assert count[7] == 2 | FINAL_BIT and done[7] == 110  # cancel keeps the published count
        assert count[8] == FINAL_BIT and done[8] == 111
        reason = {slot: region.read_status(slot + 3) for slot in range(9)}
        expect = {1: (2, 0, 1), 2: (1, 0, 1), 4: (1, 0, 1), 5: (1, 0, 1), 6: (2, 0, 1), 7: (3, 0, 0)}
        expect[8] = (4, int(ErrorCode.STOP_IDS), 0)
        for slot, (why, err, terminal) in expect.items():
            st = reason[slot]
            assert (int(st["finish_reason"]), int(st["error_code"]), int(st["terminal_token"])) == (
                why,
                err,
                terminal,
            ), slot
            assert int(st["finish_ns"]) > 0
        assert int(reason[0]["finish_reason"]) == 0

        # Slot state: appended tokens, released slots FREE with cleared tables.
        assert state.token_ids[0, :5].tolist() == [5, 6, 7, 9, 41] and int(state.num_tokens[0]) == 5
        assert int(state.num_tokens[1]) == 4 and state.token_ids[1, 3] == 42
        assert [SlotState(int(v)) for v in state.slot_state[:9]] == [
            SlotState.RUNNING, SlotState.FREE, SlotState.FREE, SlotState.RUNNING, SlotState.FREE,
            SlotState.FREE, SlotState.FREE, SlotState.FREE, SlotState.FREE,
        ]  # fmt: skip
        for slot in (1, 2, 4, 5, 6, 7, 8):
            assert int(state.num_blocks[slot]) == 0 and (state.block_table[slot] == -1).all(), slot
        assert int(state.finish_reason[7]) == 0 and int(state.error_code[8]) == 0
        # The free stack: released tables pushed in reverse, finished rows in row order, then FINISHING
        # slots; popping now hands out slot 7's blocks first, in their original order.
        released = 1 + 2 + 1 + 1 + 3 + 2
        assert int(state.free_top[0]) == top_before + released
        top = int(state.free_top[0])
        assert state.free_blocks[top - 2 : top].flip(0).tolist() == cancel_blocks
        assert state.free_blocks[top_before + 1 : top_before + 3].flip(0).tolist() == eos_blocks
        held = state.block_table[[0, 3]]
        free = state.free_blocks[:top].tolist()
        assert sorted(free + held[held >= 0].tolist()) == list(range(GEOMETRY.num_kv_blocks))
        assert int(state.num_active[0]) == 2
        counters = state.counters
        assert int(counters[COUNTER_INDEX["generated_tokens"]]) == 7
        assert (
            int(counters[COUNTER_INDEX["requests_finished"]]) == 5 + 1
        )  # the rejected record is not counted
        assert int(state.keep_running[0]) == 1


def test_shutdown_seen_drops_keep_running_and_capacity_guard():
    with shm_region(RING) as transport:
        region = RingRegion.attach(transport, RING)
        state = DeviceState.allocate(GEOMETRY, "cpu")
        commit = DeviceCommit(GEOMETRY, state, region_tensor(transport), RingLayout.of(RING))
        # A slot whose output already fills the channel (admission should have refused it): no write
        # past the channel, LENGTH with no token, the published count stays.
        full = RING.max_output_tokens
        claim(region, 0, published=full)
        admit(
            state, 0, chan=0, prompt=[1], generated=[5] * full, blocks=take_blocks(state, 3), max_tokens=100
        )
        state.sample_slot[0], state.sampled[0] = 0, 17
        state.shutdown_seen[0] = 1
        commit.launch()
        assert int(region.load_progress(0, "count")) == full | FINAL_BIT
        status = region.read_status(0)
        assert int(status["finish_reason"]) == 2 and int(status["terminal_token"]) == 0
        assert int(state.counters[COUNTER_INDEX["generated_tokens"]]) == 0
        assert int(state.keep_running[0]) == 0 and int(state.num_active[0]) == 0
        assert int(state.free_top[0]) == GEOMETRY.num_kv_blocks


def test_channel_of_a_row_is_published_in_order_words_are_final_last():
    """What a front end polling mid-way could see is consistent: tokens before count, count before done
    (checked on the bytes a RingRegion reads after each launch of a multi-token run)."""
    with shm_region(RING) as transport:
        region = RingRegion.attach(transport, RING)
        state = DeviceState.allocate(GEOMETRY, "cpu")
        commit = DeviceCommit(GEOMETRY, state, region_tensor(transport), RingLayout.of(RING))
        claim(region, 5)
        admit(state, 0, chan=5, prompt=[3, 4], generated=[], blocks=take_blocks(state, 1), max_tokens=4)
        stream = [11, 12, 13, 14]
        for n, token in enumerate(stream):
            state.sample_slot[0], state.sampled[0] = 0, token
            commit.launch()
            count = region.load_progress(5, "count")
            out, _ = region.read_output(5, 0, (count & ~FINAL_BIT))
            assert out.tolist() == stream[: n + 1]
            assert bool(count & FINAL_BIT) == (n == 3)
            assert region.load_progress(5, "done") == (105 if n == 3 else 0)
        assert np.array_equal(state.token_ids[0, :6].numpy(), np.array([3, 4, *stream], dtype=np.int32))


def test_a_step_that_ran_a_forward_is_timed_into_the_histogram_an_idle_one_is_not():
    with shm_region(RING) as transport:
        state = DeviceState.allocate(GEOMETRY, "cpu")
        commit = DeviceCommit(GEOMETRY, state, region_tensor(transport), RingLayout.of(RING))
        last = COUNTER_INDEX["last_step_ns"]
        state.step_num_tokens[0] = 0  # an idle iteration: nothing to time
        state.step_start_ns[0] = time.monotonic_ns() - 10**9
        commit.launch()
        assert int(state.step_time_hist.sum()) == 0 and int(state.counters[last]) == 0
        # The host stamps the end inside the launch (interpreter), so the step took its nominal time
        # plus however long the launch took to stamp it; a loaded host stretches that, never below.
        # 50 ms: a CPU-sized step has a bucket of its own; only past 16.8 s is it unbounded.
        times = ((600, 5), (3_000, 7), (20_000, 10), (50_000, 11), (20_000_000, len(STEP_TIME_BOUNDS_US)))
        want = torch.zeros_like(state.step_time_hist)
        for step_us, bucket in times:
            assert step_time_bucket(step_us * 1000) == bucket
            state.step_num_tokens[0] = 8
            before = time.monotonic_ns()
            state.step_start_ns[0] = before - step_us * 1000
            commit.launch()
            launch_ns = time.monotonic_ns() - before
            got = int(state.counters[last])
            assert step_us * 1000 <= got <= step_us * 1000 + launch_ns, step_us
            want[step_time_bucket(got)] += 1
            assert torch.equal(state.step_time_hist, want), step_us


def test_arguments_are_bound_to_the_kernels_parameters_by_name():
    """Every parameter of commit_kernel gets exactly one value by its name (Triton refuses unknown
    names and missing ones); the codes come from their one definition."""
    with shm_region(RING) as transport:
        state = DeviceState.allocate(GEOMETRY, "cpu")
        commit = DeviceCommit(GEOMETRY, state, region_tensor(transport), RingLayout.of(RING))
        args, constexprs = commit._args, commit._constexprs
        assert not set(args) & set(constexprs)
        assert set(args) | set(constexprs) == set(commit_kernel.arg_names)
        assert args["sampled_ptr"] is state.sampled and args["step_time_hist_ptr"] is state.step_time_hist
        assert constexprs["SLOT"].FINISHING == SlotState.FINISHING
        assert constexprs["COUNTER"].last_step_ns == COUNTER_INDEX["last_step_ns"]


_COMPILE_FOR_H100 = """
import torch
from blink_appliance.engine.loop.commit import DeviceCommit
from blink_appliance.engine.loop.state import DeviceState, LoopGeometry
from blink_appliance.kernels.commit import commit_kernel
from blink_appliance.wire.ring_layout import RingGeometry, RingLayout
from tests.sm90_ptx import ptx_for_sm90

geometry, ring_geometry = {geometry!r}, {ring!r}
layout = RingLayout.of(ring_geometry)
region = torch.zeros(layout.size, dtype=torch.uint8)
commit = DeviceCommit(geometry, DeviceState.allocate(geometry, "cpu"), region, layout)
ptx = ptx_for_sm90(commit_kernel, commit._args, commit._constexprs, num_warps=4, scalar="i32")
print("release", ptx.count("st.release.sys.global.u64"), "fence", ptx.count("fence.acq_rel.sys"),
      "clock", ptx.count("%globaltimer"), "local", ptx.count(".local"))
"""


def test_kernel_compiles_for_the_h100():
    """The GPU path (predicated release stores, system fences, %globaltimer) compiles for sm_90 here,
    without a GPU. Run in a child process, since TRITON_INTERPRET is set in this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    source = _COMPILE_FOR_H100.format(geometry=GEOMETRY, ring=RING)
    done = subprocess.run(
        [sys.executable, "-c", source], cwd=Path(__file__).parent.parent, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode and (
        "ptxas" in done.stderr or "No module named 'triton.backends.nvidia" in done.stderr
    ):
        pytest.skip(f"no CUDA compiler backend in this install: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    # count and done of the sampled rows and of the FINISHING slots; a fence before each of those
    # publications' barriers; one clock read; no register spills.
    assert done.stdout.split() == ["release", "4", "fence", "4", "clock", "1", "local", "0"], done.stdout
