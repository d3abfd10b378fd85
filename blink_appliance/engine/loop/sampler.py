"""The GPU loop's sample step: DeviceState rows + the forward's logits -> state.sampled.

Four capturable variants, chosen by state.sampler_index (a SWITCH in the loop's graph; host mode
reads it; schedule picks the cheapest that serves every row, kernels/sampling.py SAMPLER_*):
`greedy` (argmax of every row), `rejection` (temperature, top-p, min-p: the exponential race with
the counter-based RNG, without sorting; kernels/sampling_rejection.py), `rejection_top_k` (the same
kernels compiled with top-k's count and cut, for rows with top-k but not top-p) and `full` (the same
and top-k with top-p in one row). All read GpuForward.logits [S, V] fp32 (row r = sample row r) and the row_* tensors
schedule wrote, and write state.sampled [S] int64. Static shapes, no host sync, no allocation that
depends on data: they run inside a CUDA graph. `greedy` and both `rejection` variants touch rows
[0, state.num_sample_rows) only; `full` samples every row, rows with sample_slot < 0 greedily
(commit ignores them).

`full` gives the tokens engine/reference/sampler.py `sample()` gives for the same logits and parameters
(docs/engine.md "Sampling"), row by row, independent of the other rows:

1. x = logits / temperature (torch; greedy rows divide by 1, so x = logits).
2. Candidates: the `candidates` largest x of every row (torch.topk), put in (value descending,
   index ascending) order. The top-k threshold is the k-th candidate; the top-p nucleus is the
   reference's sequential prefix sum over the candidates, with the logsumexp over all top-k
   survivors (kernels/sampling.masked_logsumexp, one read of x). Together they give the cut
   (v_cut, i_cut): the last kept token of the kept prefix.
   The cut is exact when k <= candidates and the nucleus ends inside the candidates strictly above
   the smallest one (or every survivor is a candidate): the reference's own fast-path condition.
3. Rows where it is not (top_k > candidates, a nucleus reaching past the candidates, ties at the
   candidates' edge) take kernels/sampling.exact_cut: bisection over the row's float order, one
   program per row; the rows that do not need it return at once.
4. min-p: x >= max(x) + log(min_p).
5. kernels/sampling.race: score = x - log(-log(u)) over the kept tokens (greedy rows: x), best per
   vocabulary chunk; the chunks are reduced with argmax (ties: lowest index).

Equality with the reference is exact in the kept sets and the random numbers; the only difference
is floating-point summation order where the reference's cannot be copied (the logsumexp, the
exact-cut path's masses, cumsum on the GPU), and the last ulp of log/exp between math libraries: a
token can differ only when two candidates' scores (or a nucleus boundary and top_p) agree to within a
few ulps (0 differences in 1440 random rows on the CPU, ties and fallbacks included).

Measured on the H100 at V = 128256 (bench/results/2026-11-26-h100-loop-at-shipped-geometry.md):
greedy 0.009 ms at one row, 0.030 ms at 64; rejection 0.02-0.03 ms at one row, 0.074 ms
(temperature) and 0.103 ms (top_p 0.9) at 64; full 0.29 ms at one row, 0.45 ms at 64, and 1.9-2.4
ms when rows take the exact-cut path (top_k > 256, or a top-p nucleus past the candidates).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import triton

from blink_appliance.engine.loop.constraint import DeviceConstraints
from blink_appliance.engine.loop.logprobs import DeviceLogprobs, DevicePromptLogprobs
from blink_appliance.engine.loop.penalties import DevicePenalties
from blink_appliance.engine.loop.state import DeviceState
from blink_appliance.kernels.sampling import (
    INT64_MAX,
    SAMPLER_FULL,
    SAMPLER_GREEDY,
    SAMPLER_REJECTION,
    SAMPLER_REJECTION_TOP_K,
    exact_cut,
    masked_logsumexp,
    race,
)
from blink_appliance.kernels.sampling_rejection import RejectionRows, SampleRows, argmax_rows
from blink_appliance.kernels.sampling_rounds import MAX_REGISTERS, TICKET_CHUNKS, race_and_test

CANDIDATES = 256  # sorted candidates per row (as the reference's TOP_P_CANDIDATES)
RACE_CHUNK = 2048  # vocabulary entries per race program
REJECTION_CHUNK = 2048  # vocabulary entries per chunk of the rejection variant and greedy argmax (H100 sweep)
REJECTION_ROUNDS = (
    3  # chunked rounds before the one-program-per-row finisher (H100, 64 rows: 3 beat 2 on the mean)
)
PROGRAMS_PER_SM = 16  # persistent programs of the chunked passes, per SM (sampler_profile --tune)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class DeviceSampler:
    """Samples one token per row of `logits` into state.sampled; `greedy()` / `full()` are capturable."""

    def __init__(
        self,
        state: DeviceState,
        logits: torch.Tensor,
        *,
        candidates: int = CANDIDATES,
        race_chunk: int = RACE_CHUNK,
        rejection_chunk: int = REJECTION_CHUNK,
        rejection_rounds: int = REJECTION_ROUNDS,
        programs_per_sm: int = PROGRAMS_PER_SM,
        rejection_ticket_chunks: int = TICKET_CHUNKS,
        rejection_max_registers: int | None = MAX_REGISTERS,
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
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        self.state = state
        self.logits = logits
        self.vocab_size = vocab
        self.candidates = min(candidates, vocab)
        self.race_chunk = min(race_chunk, triton.next_power_of_2(vocab))
        device = logits.device
        # The Triton kernels use libdevice's log/exp on the GPU (torch's own), numpy's when interpreted.
        self.precise = device.type == "cuda" and not _interpreted()
        self._x = torch.empty_like(logits)
        n_chunks = triton.cdiv(vocab, self.race_chunk)
        self._part_score = torch.empty(rows, n_chunks, dtype=torch.float32, device=device)
        self._part_index = torch.empty(rows, n_chunks, dtype=torch.int64, device=device)
        self._lse = torch.empty(rows, dtype=torch.float32, device=device)
        self.rejection_chunk = min(rejection_chunk, triton.next_power_of_2(vocab))
        self.rejection_rounds = rejection_rounds
        self.rejection_ticket_chunks = rejection_ticket_chunks
        self.rejection_max_registers = rejection_max_registers
        self._rejection = RejectionRows.allocate(rows, triton.cdiv(vocab, self.rejection_chunk), device)
        # Persistent programs of the chunked passes: enough to fill the GPU, so that a step's cost
        # follows its rows (state.num_sample_rows), not the loop's max_num_seqs.
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = programs_per_sm * sms
        by_index = {
            SAMPLER_GREEDY: self.greedy, SAMPLER_REJECTION: self.rejection,
            SAMPLER_REJECTION_TOP_K: self.rejection_top_k, SAMPLER_FULL: self.full,
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

    # -- the two variants (capturable) --------------------------------------------------------------
    def greedy(self) -> None:
        """argmax of the step's rows, ties to the lowest index (as torch.argmax and the reference)."""
        argmax_rows(
            self.logits, self.state.num_sample_rows, self._rejection, self.state.sampled,
            chunk=self.rejection_chunk, programs=self.programs,
        )  # fmt: skip

    def full(self) -> None:
        st = self.state
        V, K = self.vocab_size, self.candidates
        random = (st.sample_slot >= 0) & (st.row_temperature > 0)
        temperature = torch.where(random, st.row_temperature, 1.0)
        x = torch.div(self.logits, temperature[:, None], out=self._x)

        cand, cand_index = x.topk(K, dim=-1)
        # topk's order among equal values is unspecified: lower index first, as the reference.
        by_index = cand_index.argsort(dim=-1)
        cand, cand_index = cand.gather(1, by_index), cand_index.gather(1, by_index)
        cand, order = cand.sort(dim=-1, descending=True, stable=True)
        cand_index = cand_index.gather(1, order)

        top_k, top_p, min_p = st.row_top_k, st.row_top_p, st.row_min_p
        on_k = random & (top_k > 0) & (top_k < V)
        kth = cand.gather(1, (top_k.clamp(1, K) - 1)[:, None])[:, 0]
        threshold = torch.where(on_k, kth, -math.inf)
        k_exact = ~on_k | (top_k <= K)

        on_p = random & (top_p < 1.0)
        lse = self._lse
        masked_logsumexp(x, cand[:, 0].contiguous(), threshold, lse, self.precise)
        cand_masked = cand.masked_fill(cand < threshold[:, None], -math.inf)
        probs = (cand_masked - lse[:, None]).exp()
        before = probs.cumsum(dim=-1) - probs
        keep = before < top_p[:, None]
        keep[:, 0] = True
        n_kept = keep.sum(dim=-1)
        n_survivors = (cand >= threshold[:, None]).sum(dim=-1)
        last = (torch.minimum(n_kept, n_survivors) - 1).clamp(min=0)[:, None]  # NaN rows: 0 survivors
        last_kept = cand.gather(1, (n_kept.clamp(max=K) - 1)[:, None])[:, 0]
        p_exact = ~on_p | (n_survivors < K) | ((n_kept < K) & (last_kept > cand[:, K - 1]))

        v_cut = torch.where(on_p, cand.gather(1, last)[:, 0], threshold)
        i_cut = torch.where(on_p, cand_index.gather(1, last)[:, 0], INT64_MAX)
        min_p_cut = cand[:, 0] + torch.log(min_p)  # log 0 = -inf keeps all
        exact = (~random | (k_exact & p_exact)).to(torch.int32)
        random_i32 = random.to(torch.int32)
        exact_cut(x, random_i32, exact, top_k, top_p, v_cut, i_cut, self.precise)

        race(
            x, random_i32, st.row_seed, st.row_output_index, v_cut, i_cut, min_p_cut,
            self._part_score, self._part_index, self.race_chunk, self.precise,
        )  # fmt: skip
        best = self._part_score.argmax(dim=-1, keepdim=True)  # first (lowest) chunk among equal scores
        st.sampled.copy_(self._part_index.gather(1, best)[:, 0])

    def rejection(self) -> None:
        """Rows without top-k: race the row, test the winner against min-p and top-p, and race again
        before it while it is not kept (kernels/sampling_rejection.py). One pass of reading when the
        first winner is kept, which a top-p row's is with probability >= top_p; a test pass more for
        a top-p row."""
        self._race_and_test(top_k=False)

    def rejection_top_k(self) -> None:
        """`rejection`, and rows with top-k but not top-p: the test also counts the tokens above the
        winner, and a rejected one cuts the region to the bins that hold the top-k set. Its own variant,
        since that code costs top-p rows 2-17 µs in the register-capped kernel."""
        self._race_and_test(top_k=True)

    def _race_and_test(self, *, top_k: bool) -> None:
        st = self.state
        rows = SampleRows(
            n_rows=st.num_sample_rows, temperature=st.row_temperature, top_p=st.row_top_p, top_k=st.row_top_k,
            min_p=st.row_min_p, seed=st.row_seed, output_index=st.row_output_index,
        )  # fmt: skip
        race_and_test(
            self.logits, rows, self._rejection, st.sampled, chunk=self.rejection_chunk,
            rounds=self.rejection_rounds, programs=self.programs, precise=self.precise, top_k=top_k,
            ticket_chunks=self.rejection_ticket_chunks, max_registers=self.rejection_max_registers,
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
