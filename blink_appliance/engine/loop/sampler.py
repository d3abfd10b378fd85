"""The GPU loop's sample step: DeviceState rows + the forward's logits -> state.sampled.

Four capturable variants, chosen by state.sampler_index (a SWITCH in the loop's graph; host mode
reads it; schedule picks the cheapest that serves every row, kernels/sampling.py SAMPLER_*):
`greedy` (argmax of every row), `rejection` (temperature, top-p, min-p: the exponential race with
the counter-based RNG, without sorting; kernels/sampling_rejection.py), `rejection_top_k` (the same
kernels compiled with top-k's count and cut, for rows with top-k but not top-p) and
`rejection_top_k_top_p` (compiled with the select of the top-k set's threshold too, for rows with
both). All read GpuForward.logits [S, V] fp32 (row r = sample row r) and the row_* tensors schedule
wrote, write state.sampled [S] int64, and touch rows [0, state.num_sample_rows) only. Static shapes,
no host sync, no allocation that depends on data: they run inside a CUDA graph.

Each gives the tokens engine/reference/sampler.py `sample()` gives for the same logits and
parameters (docs/engine.md "Sampling"), row by row, independent of the other rows: the kept sets and
the random numbers are exact; the masses of a top-p test are summed in another order than the
reference's (kernels/sampling_rejection.py MASS_PRECISION), so a token can differ only where the mass
ranked before a candidate lies within that rounding of top_p.

Measured on the H200 at V = 128256 with the loop's 256 rows allocated
(bench/results/2026-11-29-h200-sampler-chunk-bound-gather.md, -top-k-gather-presence.md): greedy
0.008 ms at one row, 0.020 ms at 64; rejection 0.02-0.04 ms at one row and 0.05-0.10 ms at 64; top-k
alone 0.04-0.06 ms and 0.09-0.19 ms; top-k with top-p 0.04 ms and 0.12-0.15 ms (top_k 1000: 0.30 and
0.51), where the sorting variant this replaced took 0.28-3.3 ms and 0.43-3.5 ms.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

from blink_appliance.engine.loop.constraint import DeviceConstraints
from blink_appliance.engine.loop.logprobs import DeviceLogprobs, DevicePromptLogprobs
from blink_appliance.engine.loop.penalties import DevicePenalties
from blink_appliance.engine.loop.state import DeviceState
from blink_appliance.kernels.sampling import (
    SAMPLER_GREEDY,
    SAMPLER_REJECTION,
    SAMPLER_REJECTION_TOP_K,
    SAMPLER_REJECTION_TOP_K_TOP_P,
)
from blink_appliance.kernels.sampling_gather import GATHER_CAP
from blink_appliance.kernels.sampling_rejection import RejectionRows, SampleRows, argmax_rows
from blink_appliance.kernels.sampling_rounds import MAX_REGISTERS, TICKET_CHUNKS, race_and_test

REJECTION_CHUNK = 2048  # vocabulary entries per chunk of the rejection variant and greedy argmax (H100 sweep)
REJECTION_ROUNDS = (
    3  # chunked rounds before the one-program-per-row finisher (H100, 64 rows: 3 beat 2 on the mean)
)
PROGRAMS_PER_SM = 16  # persistent programs of the chunked passes, per SM (sampler_profile --tune)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class DeviceSampler:
    """Samples one token per row of `logits` into state.sampled; every variant is capturable."""

    def __init__(
        self,
        state: DeviceState,
        logits: torch.Tensor,
        *,
        rejection_chunk: int = REJECTION_CHUNK,
        rejection_rounds: int = REJECTION_ROUNDS,
        programs_per_sm: int = PROGRAMS_PER_SM,
        rejection_ticket_chunks: int = TICKET_CHUNKS,
        rejection_max_registers: int | None = MAX_REGISTERS,
        rejection_gather_cap: int = GATHER_CAP,
        logprobs: DeviceLogprobs | None = None,
        penalties: DevicePenalties | None = None,
        prompt_logprobs: DevicePromptLogprobs | None = None,
        constraints: DeviceConstraints | None = None,
    ) -> None:
        rows, vocab = logits.shape
        if logits.dtype != torch.float32:
            raise ValueError(f"the sampler reads fp32 logits, got {logits.dtype}")
        if rows != state.sampled.shape[0]:
            raise ValueError(f"logits have {rows} rows; the loop samples {state.sampled.shape[0]}")
        self.state = state
        self.logits = logits
        self.vocab_size = vocab
        device = logits.device
        # The Triton kernels use libdevice's log/exp on the GPU (torch's own), numpy's when interpreted.
        self.precise = device.type == "cuda" and not _interpreted()
        self.rejection_chunk = min(rejection_chunk, triton.next_power_of_2(vocab))
        self.rejection_rounds = rejection_rounds
        self.rejection_ticket_chunks = rejection_ticket_chunks
        self.rejection_max_registers = rejection_max_registers
        self.rejection_gather_cap = rejection_gather_cap
        self._rejection = RejectionRows.allocate(rows, triton.cdiv(vocab, self.rejection_chunk), device)
        # Persistent programs of the chunked passes: enough to fill the GPU, so that a step's cost
        # follows its rows (state.num_sample_rows), not the loop's max_num_seqs.
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = programs_per_sm * sms
        by_index = {
            SAMPLER_GREEDY: self.greedy, SAMPLER_REJECTION: self.rejection,
            SAMPLER_REJECTION_TOP_K: self.rejection_top_k, SAMPLER_REJECTION_TOP_K_TOP_P: self.rejection_top_k_top_p,
        }  # fmt: skip
        base = tuple(by_index[i] for i in range(len(by_index)))
        # Then each again followed by the logprob rows (SAMPLER_LOGPROBS + i), and all of those again
        # after the penalties (SAMPLER_PENALTIES + i), when the loop has them.
        self.logprobs, self.penalties, self.constraints = logprobs, penalties, constraints
        # Without a logprob area schedule refuses every record that asks for logprobs, so indices
        # SAMPLER_LOGPROBS + i are never picked: the plain variants only hold their places.
        variants = base
        if logprobs is not None or penalties is not None:
            variants += tuple(self._then_logprobs(v) for v in base) if logprobs is not None else base
        if penalties is not None:
            variants += tuple(self._after_penalties(v) for v in variants)
        # And all of those again after the scored prompt rows (SAMPLER_SCORE + i), when the loop
        # scores prompts (it needs the logprob area and the penalty variants' places).
        self.prompt_logprobs = prompt_logprobs
        if prompt_logprobs is not None:
            if logprobs is None or penalties is None:
                raise ValueError("scoring prompts needs the logprob and penalty variants in their places")
            variants += tuple(self._after_scoring(v) for v in variants)
        self._variants = variants  # host mode looks one up per step

    # -- the variants (capturable) --------------------------------------------------------------
    def greedy(self) -> None:
        """argmax of the step's rows, ties to the lowest index (as torch.argmax and the reference)."""
        argmax_rows(
            self.logits, self.state.num_sample_rows, self._rejection, self.state.sampled,
            chunk=self.rejection_chunk, programs=self.programs,
        )  # fmt: skip

    def rejection(self) -> None:
        """Rows without top-k: race the row, test the winner against min-p and top-p, and race again
        before it while it is not kept (kernels/sampling_rejection.py). One pass of reading when the
        first winner is kept, which a top-p row's is with probability >= top_p; a test pass more for
        a top-p row."""
        self._race_and_test(top_k=False)

    def rejection_top_k(self) -> None:
        """`rejection`, and rows with top-k but not top-p: the test also counts the tokens above the
        winner, and a rejected one cuts the region to the bins that hold the top-k set. A row whose
        first winner lies below k chunk maxima gathers its candidates instead (kernels/sampling_gather.py).
        Its own variant, since that code costs top-p rows 2-17 µs in the register-capped kernel."""
        self._race_and_test(top_k=True)

    def rejection_top_k_top_p(self) -> None:
        """`rejection_top_k`, and rows with top-k and top-p, whose nucleus the reference normalises over
        the top-k set: their test bounds that set's mass, and where the bounds cannot decide, a select
        finds the set's threshold (kernels/sampling_select.py). A row whose first winner lies below k
        chunk maxima gathers its candidates instead, as in `rejection_top_k`. Its own variant, since
        that code costs rows of top-k alone."""
        self._race_and_test(top_k=True, both=True)

    def _race_and_test(self, *, top_k: bool, both: bool = False) -> None:
        st = self.state
        rows = SampleRows(
            n_rows=st.num_sample_rows, temperature=st.row_temperature, top_p=st.row_top_p, top_k=st.row_top_k,
            min_p=st.row_min_p, seed=st.row_seed, output_index=st.row_output_index,
        )  # fmt: skip
        race_and_test(
            self.logits, rows, self._rejection, st.sampled, chunk=self.rejection_chunk,
            rounds=self.rejection_rounds, programs=self.programs, precise=self.precise, top_k=top_k, both=both,
            ticket_chunks=self.rejection_ticket_chunks, max_registers=self.rejection_max_registers,
            gather_cap=self.rejection_gather_cap,
        )  # fmt: skip

    def _then_logprobs(self, variant: Callable[[], None]) -> Callable[[], None]:
        def sample_then_logprobs() -> None:
            variant()
            self.logprobs.launch()

        return sample_then_logprobs

    def _after_penalties(self, variant: Callable[[], None]) -> Callable[[], None]:
        """The penalties, then the constraints' mask, the variant, and the constraints' states."""

        def penalties_then_sample() -> None:
            self.penalties.launch()
            if self.constraints is not None:
                self.constraints.mask()
            variant()
            if self.constraints is not None:
                self.constraints.advance()

        return penalties_then_sample

    def _after_scoring(self, variant: Callable[[], None]) -> Callable[[], None]:
        def score_then_sample() -> None:
            self.prompt_logprobs.launch()
            variant()

        return score_then_sample

    def variants(self) -> tuple[Callable[[], None], ...]:
        """The variants by sampler_index (kernels/sampling.py SAMPLER_*)."""
        return self._variants

    # -- host mode ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Host-driven: read sampler_index (a sync) and run that variant; other values run none, as
        the loop's SWITCH does."""
        index = int(self.state.sampler_index[0])
        variants = self.variants()
        if 0 <= index < len(variants):
            variants[index]()
