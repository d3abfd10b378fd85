"""The GPU loop's commit step, host side: binds DeviceState and the mapped ring to kernels/commit.py.

`DeviceCommit(geometry, state, region, layout).launch()` appends the step's sampled tokens, writes
them (and terminal events) into the ring's output side, releases finished slots and their KV
blocks, updates the counters and writes keep_running. One Triton program, no host sync: capturable.
What it does, in order, and the publication protocol it follows: kernels/commit.py's docstring and
docs/device_loop.md ("commit").

`region` is the whole shared region as a uint8 tensor on the loop's device (on the GPU the
cudaHostRegister-mapped view, engine/loop/mapped_region.py: `MappedRegion.tensor(0, torch.uint8,
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

from blink_appliance.engine.loop import kernel_args
from blink_appliance.engine.loop.state import MAX_EOS_IDS, DeviceState, LoopGeometry
from blink_appliance.kernels.commit import commit_kernel
from blink_appliance.wire.ring_layout import STEP_TIME_BOUNDS_US, RingLayout

NUM_WARPS = 4  # the commit program is one CTA of this many warps

# The DeviceState tensors commit_kernel takes, each as `<name>_ptr`.
_STATE_TENSORS = (
    "sample_slot", "sampled", "slot_state", "chan", "generation", "prompt_len", "num_tokens", "max_tokens",
    "ignore_eos", "n_stop", "stop_ids", "token_ids", "block_table", "num_blocks", "finish_reason",
    "error_code", "free_blocks", "free_top", "block_ref", "block_cached", "block_key", "cache_table", "lru",
    "lru_pos", "lru_words", "evicted", "num_active", "shutdown_seen", "keep_running",
    "clock_offset_ns", "counters", "step_start_ns", "step_num_tokens", "step_time_hist",
)  # fmt: skip


class DeviceCommit:
    def __init__(
        self, geometry: LoopGeometry, state: DeviceState, region: torch.Tensor, layout: RingLayout
    ) -> None:
        device = state.sampled.device
        self.num_warps = NUM_WARPS  # bench/loop_profile.py --commit-warps varies it
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
        g = geometry
        # The kernel's arguments by parameter name (a tensor `<name>` as `<name>_ptr`), each
        # parameter given once (kernel_args.check_parameters below).
        self._args = {f"{name}_ptr": getattr(state, name) for name in _STATE_TENSORS}
        self._args |= dict(
            host_clock_ns_ptr=self.host_clock_ns, eos_ptr=self._eos, step_bounds_ptr=self._step_bounds_ns,
            ring64_ptr=self._ring64, ring32_ptr=self._ring32,
            tokens_at=layout.tokens // 4, times_at=layout.times // 8, prog_at=layout.chan_prog,
            stat_at=layout.chan_stat, S=g.max_num_seqs, D=g.num_slots,
            max_output_tokens=layout.geometry.max_output_tokens, max_inflight=layout.geometry.max_inflight,
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
            NUM_STEP_BUCKETS=len(STEP_TIME_BOUNDS_US) + 1,
            BLOCK_H=triton.next_power_of_2(len(STEP_TIME_BOUNDS_US) + 1),
            Q=g.lru_capacity,
            SLOT=kernel_args.SLOT_STATES,
            FINISH=kernel_args.FINISH_REASONS,
            COUNTER=kernel_args.COMMIT_COUNTERS,
            CHANNEL=kernel_args.CHANNEL_LAYOUT,
            ON_GPU=self.device_clock,
        )
        kernel_args.check_parameters(commit_kernel, self._args, self._constexprs)
        for name, value in (("chan_prog", layout.chan_prog), ("chan_stat", layout.chan_stat)):
            if value % 8:
                raise AssertionError(f"ring section {name} at {value} is not 8-byte aligned")

    def launch(self) -> None:
        """Commit this step (capturable on the GPU: one kernel, no sync)."""
        if not self.device_clock:
            self.host_clock_ns.fill_(time.monotonic_ns())
        commit_kernel[(1,)](**self._args, **self._constexprs, num_warps=self.num_warps)

    def compile(self) -> None:
        """Compile the kernel for these arguments without running it (before a graph capture). Nothing
        to do where the kernel is interpreted."""
        if self.device_clock:
            commit_kernel.warmup(grid=(1,), **self._args, **self._constexprs, num_warps=self.num_warps)
