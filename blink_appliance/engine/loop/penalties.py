"""The GPU loop's penalties and logit biases: each penalized sample row's logits changed in place
before the sampler and the logprobs read them (kernels/penalties.py), as engine/reference/penalties.py
changes them. It runs only in the sampler variants that schedule picks when a row of the step has a
penalty or a bias (kernels/sampling.py SAMPLER_PENALTIES)."""

from __future__ import annotations

import os

import torch

from blink_appliance.engine.loop.state import DeviceState
from blink_appliance.kernels.penalties import penalize_rows

PROGRAMS_PER_SM = 2


class DevicePenalties:
    def __init__(self, state: DeviceState, logits: torch.Tensor) -> None:
        rows, vocab = logits.shape
        self.state = state
        self.logits = logits
        # Occurrence counts per row, all 0 between launches (the kernel takes back what it adds).
        self.counts = torch.zeros(rows * vocab, dtype=torch.int32, device=logits.device)
        device = logits.device
        self.precise = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = PROGRAMS_PER_SM * sms
        self.slots = state.tensors()  # by name, once: the tensors never move

    def launch(self) -> None:
        st = self.state
        penalize_rows(
            self.logits, st.num_sample_rows, st.sample_slot, self.slots, self.counts,
            max_model_len=st.token_ids.shape[1], max_bias=st.bias_ids.shape[1], programs=self.programs,
            precise=self.precise,
        )  # fmt: skip
