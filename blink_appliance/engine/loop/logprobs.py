"""The GPU loop's logprobs: after the sampler, the sampled token's log-probability and the N most likely
tokens of each row whose request asked, written into the ring's logprob area (kernels/logprobs.py).

The same function as engine/reference/logprobs.py. It runs only in the sampler variants that
schedule picks when a row of the step asks (kernels/sampling.py SAMPLER_LOGPROBS), so a step whose
rows ask for none pays nothing.

`DevicePromptLogprobs` scores prompt positions (`echo` with `logprobs`) the same way: schedule picks
at most prompt_score_chunk positions of one sequence a step (Scheduler phase 6) and writes their
token rows into the forward's score_rows, which the forward's final norm gathers; the variants with
SAMPLER_SCORE run the LM head over those rows (GpuForward.score) and the same two kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable

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
        self,
        state: DeviceState,
        logits: torch.Tensor,
        ring: torch.Tensor,
        layout: RingLayout,
        max_rows: int = 0,
    ) -> None:
        rows, vocab = logits.shape
        rows = max(rows, max_rows)  # the scratch serves `rows()` over other logits of up to max_rows rows
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
        self.rows(
            self.logits,
            st.num_sample_rows,
            st.sample_slot,
            st.row_temperature,
            st.row_output_index,
            st.sampled,
        )

    def rows(
        self,
        logits: torch.Tensor,
        n_rows: torch.Tensor,
        slot: torch.Tensor,
        temperature: torch.Tensor,
        index: torch.Tensor,
        token: torch.Tensor,
    ) -> None:
        """Rows [0, n_rows) of `logits`: each `slot`'s row `index` (relative to its first output
        token's) gets `token` with its logprob and the most likely ones. Capturable."""
        row_logprobs(
            logits, n_rows, slot, self.state.lp_top_n, self.state.lp_offset, temperature, index, token,
            self.scratch, self.ring, off_logprobs=self.layout.logprobs, chunk=self.chunk, max_n=MAX_N,
            programs=self.programs, precise=self.precise, on_gpu=self.on_gpu,
        )  # fmt: skip


class DevicePromptLogprobs:
    """The scored prompt positions' logprob rows: the LM head over the rows the forward gathered,
    then the same kernels as the sample rows'. `launch` is capturable."""

    def __init__(
        self, state: DeviceState, score: Callable[[], torch.Tensor], logprobs: DeviceLogprobs
    ) -> None:
        self.state = state
        self.score = score
        self.logprobs = logprobs

    def launch(self) -> None:
        st = self.state
        logits = self.score()
        self.logprobs.rows(
            logits, st.num_score_rows, st.score_slot, st.score_temperature, st.score_index, st.score_token
        )
