"""The schedule step's launch and kernel: capturable by construction, arguments bound by name, the
GPU path compiled for sm_90 without a GPU, the launcher's own checks."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels import (  # noqa: E402
    prefix_cache,
    ring_access,
    schedule_batch,
    schedule_records,
    schedule_step,
)
from blink_appliance.kernels import schedule as schedule_module  # noqa: E402

from blink_appliance.engine.loop import kernel_args  # noqa: E402
from blink_appliance.engine.loop.scheduler import PHASES, DeviceScheduler  # noqa: E402
from blink_appliance.wire.ring_layout import RingLayout  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, RING  # noqa: E402


def test_launch_is_capturable_by_construction():
    """No host sync, allocation or host-visible value in the launch path (a CUDA graph replays it)."""
    launch = inspect.getsource(DeviceScheduler.launch)
    body = launch.split('"""')[-1]
    assert "schedule_kernel[(1,)](**self._args, **self._constants" in body
    assert not re.search(r"\.item\(|\.tolist\(|\.cpu\(|torch\.|int\(|float\(|synchronize|if |for ", body)
    for module in (
        schedule_module,
        schedule_batch,
        prefix_cache,
        schedule_records,
        schedule_step,
        ring_access,
    ):
        assert not re.search(r"\.item\(|\.tolist\(|synchronize", inspect.getsource(module)), module.__name__


_COMPILE_FOR_H100 = """
import dataclasses
import sys

import torch
from blink_appliance.engine.loop.scheduler import DeviceScheduler
from blink_appliance.engine.loop.state import DeviceState
from blink_appliance.kernels.schedule import schedule_kernel
from blink_appliance.model.step_inputs import StepInputs
from blink_appliance.wire.ring_layout import RingLayout
from tests.sm90_ptx import ptx_for_sm90
from tests.twin_front_end import LOOP, RING

LOOP = dataclasses.replace(LOOP, lower_class_limit=int(sys.argv[1]), best_effort_batch=int(sys.argv[2]))
layout = RingLayout.of(RING)
ring = torch.zeros(layout.size, dtype=torch.uint8)
inputs = StepInputs.allocate(
    LOOP.max_num_batched_tokens, LOOP.max_num_seqs, LOOP.max_blocks_per_seq, "cpu", LOOP.prompt_score_chunk
)
sched = DeviceScheduler(LOOP, DeviceState.allocate(LOOP, "cpu"), ring, layout, inputs, 1)
ptx = ptx_for_sm90(schedule_kernel, sched._args, sched._constants, num_warps=sched.num_warps)
print("acquire", ptx.count("ld.acquire.sys.global.u64"), "predicated", ptx.count("@p ld.acquire.sys.global.u64"),
      "release", ptx.count("st.release.sys.global.u64"),
      "local", ptx.count(".local"))
"""


def test_arguments_are_bound_to_the_kernels_parameters_by_name():
    """Every parameter of schedule_kernel gets exactly one value by its name: tensors and scalars in
    _args, compile-time values in _constants; a name too many or too few fails at construction."""
    t = Twin()
    kernel, args, constants = schedule_module.schedule_kernel, t.scheduler._args, t.scheduler._constants
    assert not set(args) & set(constants)
    assert set(args) | set(constants) == set(kernel.arg_names)
    assert args["slot_state_ptr"] is t.state.slot_state and args["block_tables_ptr"] is t.inputs.block_tables
    assert constants["RECORD"].prompt_len == RingLayout.of(RING).request.fields["prompt_len"][1]
    with pytest.raises(TypeError, match="bogus_ptr"):
        kernel_args.check_parameters(kernel, dict(args, bogus_ptr=t.state.chan), constants)
    with pytest.raises(TypeError, match="chan_ptr"):
        kernel_args.check_parameters(kernel, {k: v for k, v in args.items() if k != "chan_ptr"}, constants)
    with pytest.raises(TypeError, match="ON_GPU"):
        kernel_args.check_parameters(kernel, dict(args, ON_GPU=False), constants)


def test_a_record_field_not_where_or_what_the_kernel_reads_is_refused():
    """The kernel reads record fields as words of fixed types at the layout's offsets; a layout that
    moves a field off its alignment, changes its type or drops it fails at construction."""
    layout = RingLayout.of(RING)
    fields = dict(layout.request.fields)
    assert kernel_args.request_fields(layout).stop_ids == fields["stop_ids"][1]

    def with_fields(changed: dict[str, tuple[object, int]]) -> RingLayout:
        spec = {**{name: fields[name][:2] for name in fields}, **changed}
        formats, offsets = zip(*spec.values(), strict=True)
        request = np.dtype(
            {"names": list(spec), "formats": formats, "offsets": offsets, "itemsize": layout.request.itemsize}
        )
        return dataclasses.replace(layout, request=request)

    with pytest.raises(ValueError, match="priority"):
        kernel_args.request_fields(with_fields({"priority": ("<u4", fields["priority"][1])}))
    with pytest.raises(ValueError, match="request_id"):
        kernel_args.request_fields(with_fields({"request_id": ("<u8", fields["request_id"][1] + 4)}))
    del fields["min_p"]
    with pytest.raises(ValueError, match="min_p"):
        kernel_args.request_fields(with_fields({}))


@pytest.mark.parametrize(("lower_class_limit", "best_effort_batch"), [(-1, -1), (0, 64)])
def test_kernel_compiles_for_the_h100(lower_class_limit, best_effort_batch):
    """The GPU path (inline PTX acquire/release on the ring) compiles for sm_90 here, without a GPU:
    the interpreter does not type-check the way the compiler does. Run in a child process, since
    TRITON_INTERPRET is set in this one. With a class cap and best-effort turns, their code
    (compiled out at -1) too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_H100, str(lower_class_limit), str(best_effort_batch)], cwd=Path(__file__).parent.parent, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode and (
        "ptxas" in done.stderr or "No module named 'triton.backends.nvidia" in done.stderr
    ):
        pytest.skip(f"no CUDA compiler backend in this install: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    # One acquire (the records' seq words), predicated to a thread per record (snap_seq_words), two
    # releases (req_tail, arena_tail), no register spills.
    assert done.stdout.split() == ["acquire", "1", "predicated", "1", "release", "2", "local", "0"], (
        done.stdout
    )


def test_engine_seed_is_checked():
    t = Twin()
    with pytest.raises(ValueError, match="engine_seed"):
        DeviceScheduler(LOOP, t.state, torch.frombuffer(t.dev_transport.buffer, dtype=torch.uint8),
                        RingLayout.of(RING), t.inputs, -1)  # fmt: skip


def test_phase_stamps_are_a_gpu_profile_and_convert_cycles_to_us():
    """stamp_phases reads the SM's cycle counter (inline PTX): refused under the interpreter. phase_us
    turns the cycle stamps into microseconds by the %globaltimer span of the whole launch."""
    t = Twin()
    if t.scheduler._constants["ON_GPU"]:  # on a GPU the twin's scheduler is the GPU's: stamps are taken
        t.scheduler.stamp_phases()
        assert t.scheduler.stamping
    else:
        with pytest.raises(RuntimeError, match="CUDA device"):
            t.scheduler.stamp_phases()
        assert not t.scheduler.stamping
    stamps = [1000 + 10 * i * i for i in range(PHASES + 1)]  # cycles, phase i takes 10 * (2i + 1)
    span_cycles = stamps[-1] - stamps[0]
    t.scheduler.stamps[: PHASES + 1] = torch.tensor(stamps)
    t.scheduler.stamps[62], t.scheduler.stamps[63] = 5_000, 5_000 + 2 * span_cycles  # 2 ns a cycle
    assert t.scheduler.phase_us() == pytest.approx([20 * (2 * i + 1) / 1e3 for i in range(PHASES)])
