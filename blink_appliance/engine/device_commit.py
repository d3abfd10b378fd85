"""The GPU loop's commit step, host side: binds DeviceState and the mapped ring to kernels/commit.py.

`DeviceCommit(geometry, state, region, layout).launch()` appends the step's sampled tokens, writes
them (and terminal events) into the ring's output side, releases finished slots and their KV
blocks, updates the counters and writes keep_running. One Triton program, no host sync: capturable.
What it does, in order, and the publication protocol it follows: kernels/commit.py's docstring and
docs/device_loop.md ("commit").

`region` is the whole shared region as a uint8 tensor on the loop's device (on the GPU the
cudaHostRegister-mapped view, transport/mapped_region.py: `MappedRegion.tensor(0, torch.uint8,
layout.size)`; on the CPU, in tests, a tensor over the same bytes the front end reads).

Timestamps: on the GPU, %globaltimer + state.clock_offset_ns (set once at boot, e.g. from
LoopControl.measure_clock_offset_ns()). Triton's interpreter has no inline assembly, so on the CPU
`launch()` stores time.monotonic_ns() into a one-element tensor just before the kernel and the kernel
stamps that (host mode only; nothing on the CPU is captured).
"""

from __future__ import annotations

import os
import time

import torch
import triton

from blink_appliance.engine.device_state import (
    COUNTER_INDEX,
    MAX_EOS_IDS,
    DeviceState,
    LoopGeometry,
    SlotState,
)
from blink_appliance.kernels import commit as kernel
from blink_appliance.transport.ring_layout import (
    CHANNEL_PROGRESS,
    CHANNEL_STATUS,
    FINISH_CODES,
    STEP_TIME_BOUNDS_US,
    FinishReason,
    RingLayout,
)


def _check_layout_constants() -> None:
    """The kernel hard-codes these (jit code cannot read dtypes); a layout change must fail here."""
    expected = {
        "status bytes": (CHANNEL_STATUS.itemsize, kernel.STATUS_BYTES.value),
        "progress bytes": (CHANNEL_PROGRESS.itemsize, kernel.PROGRESS_BYTES.value),
        "status.finish_ns": (CHANNEL_STATUS.fields["finish_ns"][1], 0),
        "status.finish_reason": (CHANNEL_STATUS.fields["finish_reason"][1], 8),
        "status.error_code": (CHANNEL_STATUS.fields["error_code"][1], 12),
        "status.terminal_token": (CHANNEL_STATUS.fields["terminal_token"][1], 16),
        "progress.count": (CHANNEL_PROGRESS.fields["count"][1], 0),
        "progress.done": (CHANNEL_PROGRESS.fields["done"][1], 8),
        "FREE": (SlotState.FREE, kernel.FREE.value),
        "RUNNING": (SlotState.RUNNING, kernel.RUNNING.value),
        "FINISHING": (SlotState.FINISHING, kernel.FINISHING.value),
        "STOP": (FINISH_CODES[FinishReason.STOP], kernel.FINISH_STOP.value),
        "LENGTH": (FINISH_CODES[FinishReason.LENGTH], kernel.FINISH_LENGTH.value),
        "ERROR": (FINISH_CODES[FinishReason.ERROR], kernel.FINISH_ERROR.value),
    }
    wrong = {name: pair for name, pair in expected.items() if pair[0] != pair[1]}
    if wrong:
        raise AssertionError(f"kernels/commit.py constants disagree with the layout/state: {wrong}")


class DeviceCommit:
    def __init__(
        self, geometry: LoopGeometry, state: DeviceState, region: torch.Tensor, layout: RingLayout
    ) -> None:
        _check_layout_constants()
        device = state.sampled.device
        if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
            raise ValueError("region must be a contiguous 1-D uint8 tensor over the whole shared region")
        if region.numel() < layout.size:
            raise ValueError(f"region holds {region.numel()} bytes; the ring layout needs {layout.size}")
        if region.device != device:
            raise ValueError(f"region is on {region.device}; the loop state is on {device}")
        if region.data_ptr() % 8:
            raise ValueError("region must start 8-byte aligned")
        if layout.geometry.max_stop_ids != geometry.max_stop_ids:
            raise ValueError(
                f"loop max_stop_ids {geometry.max_stop_ids} != ring max_stop_ids {layout.geometry.max_stop_ids}"
            )
        if len(geometry.eos_token_ids) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} eos token ids")
        self.geometry = geometry
        self.state = state
        self.layout = layout
        self.device_clock = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        self.host_clock_ns = torch.zeros(1, dtype=torch.int64, device=device)
        eos = list(geometry.eos_token_ids) + [-1] * (MAX_EOS_IDS - len(geometry.eos_token_ids))
        self._eos = torch.tensor(eos, dtype=torch.int32, device=device)
        self._step_bounds_ns = torch.tensor(
            [b * 1000 for b in STEP_TIME_BOUNDS_US], dtype=torch.int64, device=device
        )
        ring = region[: layout.size]
        self._ring64, self._ring32 = ring.view(torch.int64), ring.view(torch.int32)
        st, g = state, geometry
        self._args = (
            st.sample_slot, st.sampled,
            st.slot_state, st.chan, st.generation, st.prompt_len, st.num_tokens, st.max_tokens,
            st.ignore_eos, st.n_stop, st.stop_ids, st.token_ids, st.block_table, st.num_blocks,
            st.finish_reason, st.error_code,
            st.free_blocks, st.free_top, st.num_active, st.shutdown_seen, st.keep_running,
            st.clock_offset_ns, self.host_clock_ns, st.counters, self._eos,
            self._ring64, self._ring32, layout.tokens // 4, layout.times // 8, layout.chan_prog, layout.chan_stat,
            st.step_start_ns, st.step_num_tokens, st.step_time_hist, self._step_bounds_ns,
            g.max_num_seqs, g.num_slots, layout.geometry.max_output_tokens, layout.geometry.max_inflight,
        )  # fmt: skip
        self._constexprs = dict(
            MAX_STOP=g.max_stop_ids,
            BLOCK_STOP=triton.next_power_of_2(g.max_stop_ids),
            MAX_EOS=MAX_EOS_IDS,
            MAX_BLOCKS=g.max_blocks_per_seq,
            MAX_MODEL_LEN=g.max_model_len,
            BLOCK_S=triton.next_power_of_2(g.max_num_seqs),
            BLOCK_D=triton.next_power_of_2(g.num_slots),
            BLOCK_B=min(64, triton.next_power_of_2(g.max_blocks_per_seq)),
            GENERATED=COUNTER_INDEX["generated_tokens"],
            FINISHED=COUNTER_INDEX["requests_finished"],
            LAST_STEP=COUNTER_INDEX["last_step_ns"],
            NUM_STEP_BUCKETS=len(STEP_TIME_BOUNDS_US) + 1,
            BLOCK_H=triton.next_power_of_2(len(STEP_TIME_BOUNDS_US) + 1),
            ON_GPU=self.device_clock,
        )
        for name, value in (("chan_prog", layout.chan_prog), ("chan_stat", layout.chan_stat)):
            if value % 8:
                raise AssertionError(f"ring section {name} at {value} is not 8-byte aligned")

    def launch(self) -> None:
        """Commit this step (capturable on the GPU: one kernel, no sync)."""
        if not self.device_clock:
            self.host_clock_ns.fill_(time.monotonic_ns())
        kernel.launch_commit(self._args, self._constexprs)

    def compile(self) -> None:
        """Compile the kernel for these arguments without running it (before a graph capture). Nothing
        to do where the kernel is interpreted."""
        if self.device_clock:
            kernel.compile_commit(self._args, self._constexprs)
