"""The GPU loop's logprobs: after the sampler, the sampled token's log-probability and the N most likely
tokens of each row whose request asked, written into the ring's logprob area (kernels/logprobs.py).

The same function as engine/reference/logprobs.py. It runs only in the sampler variants that
schedule picks when a row of the step asks (kernels/sampling.py SAMPLER_LOGPROBS), so a step whose
rows ask for none pays nothing. The loop does not score prompts: records with prompt_logprobs are
refused at admission, and the front end refuses `echo` with `logprobs` on a loop model.
"""

from __future__ import annotations

import os

import torch
import triton

from blink_appliance.engine.loop.state import DeviceState
from blink_appliance.kernels.logprobs import row_logprobs
from blink_appliance.wire.request import MAX_LOGPROBS
from blink_appliance.wire.ring_layout import RingLayout

LOGPROB_CHUNK = 2048  # vocabulary entries per program of the chunk pass
MAX_N = triton.next_power_of_2(MAX_LOGPROBS)  # candidates kept per chunk (a power of two for the tile)
PROGRAMS_PER_SM = 8


class DeviceLogprobs:
    def __init__(
        self, state: DeviceState, logits: torch.Tensor, ring: torch.Tensor, layout: RingLayout
    ) -> None:
        rows, vocab = logits.shape
        self.state = state
        self.logits = logits
        self.ring = ring
        self.layout = layout
        self.chunk = min(LOGPROB_CHUNK, triton.next_power_of_2(vocab))
        chunks = triton.cdiv(vocab, self.chunk)
        device = logits.device
        self.scratch = (
            torch.empty(rows * chunks, dtype=torch.float32, device=device),
            torch.empty(rows * chunks, dtype=torch.float32, device=device),
            torch.empty(rows * chunks * MAX_N, dtype=torch.float32, device=device),
            torch.empty(rows * chunks * MAX_N, dtype=torch.int64, device=device),
        )
        on_gpu = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
        self.on_gpu = self.precise = on_gpu
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = PROGRAMS_PER_SM * sms

    def launch(self) -> None:
        """The rows of this step's tokens (schedule's sample rows, the sampler's `sampled`). Capturable."""
        st = self.state
        row_logprobs(
            self.logits, st.num_sample_rows, st.sample_slot, st.lp_top_n, st.lp_offset, st.row_temperature,
            st.row_output_index, st.sampled, self.scratch, self.ring, off_logprobs=self.layout.logprobs,
            chunk=self.chunk, max_n=MAX_N, programs=self.programs, precise=self.precise, on_gpu=self.on_gpu,
        )  # fmt: skip
