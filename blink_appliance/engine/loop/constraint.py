"""Structured output in the GPU loop: the same function as engine/reference/constraint.py, on the
device (kernels/constraint.py). `mask()` runs after the penalties and before the sampler variant,
in the variants schedule picks when a row is penalized or constrained (kernels/sampling.py
SAMPLER_PENALTIES); `advance()` runs after the variant (and its logprobs) and moves each
constrained slot's state by its sampled token. Schedule copies each admitted request's automaton
from the ring into `state.constraint_arena`, at its offset in the ring's constraint area, so
these kernels read device memory only.
"""

from __future__ import annotations

import os

import torch
import triton

from blink_appliance.engine.loop.state import MAX_EOS_IDS, DeviceState, LoopGeometry
from blink_appliance.kernels.constraint import advance_rows, mask_rows

MASK_CHUNK = 2048  # vocabulary entries per program of the mask
PROGRAMS_PER_SM = 8


class DeviceConstraints:
    def __init__(self, geometry: LoopGeometry, state: DeviceState, logits: torch.Tensor) -> None:
        device = logits.device
        self.state = state
        self.logits = logits
        eos = list(geometry.eos_token_ids) + [-1] * (MAX_EOS_IDS - len(geometry.eos_token_ids))
        self.eos = torch.tensor(eos, dtype=torch.int32, device=device)
        self.chunk = min(MASK_CHUNK, triton.next_power_of_2(geometry.vocab_size))
        self.steps = geometry.vocab_size.bit_length() + 1  # binary search over at most vocab_size edges
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = PROGRAMS_PER_SM * sms if os.environ.get("TRITON_INTERPRET") != "1" else 4

    def mask(self) -> None:
        st = self.state
        mask_rows(
            self.logits, st.num_sample_rows, st.sample_slot, st.c_offset, st.c_state, st.constraint_arena,
            self.eos, chunk=self.chunk, programs=self.programs, steps=self.steps,
        )  # fmt: skip

    def advance(self) -> None:
        st = self.state
        advance_rows(
            st.num_sample_rows, st.sample_slot, st.sampled, st.c_offset, st.c_state, st.constraint_arena,
            steps=self.steps,
        )  # fmt: skip
