"""Runs one scheduled step: the model's forward over the paged KV cache, then the sampler (and the
log-probabilities of requests that ask for them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from blink_appliance.engine.reference.constraint import mask_constrained
from blink_appliance.engine.reference.logprobs import token_logprobs
from blink_appliance.engine.reference.penalties import penalize
from blink_appliance.engine.reference.sampler import SamplingTensors, sample
from blink_appliance.engine.reference.scheduler import ScheduledChunk, SchedulerOutput, build_forward_batch
from blink_appliance.model.kv_cache import PagedKVCache
from blink_appliance.model.llama import LlamaModel
from blink_appliance.wire.request import TokenLogprobs


@dataclass
class StepOutput:
    tokens: list[int]  # one per sampling chunk, in batch order
    logprobs: list[TokenLogprobs | None]  # of each sampled token, where its request asked
    # Per prompt-logprob chunk: the positions it scored (their predicting rows were in this step).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


def _prompt_positions(chunk: ScheduledChunk) -> range:
    """Prompt positions p >= 1 of a chunk's sequence whose predicting row p - 1 this chunk feeds and
    that are not scored yet (a recomputed prefill scores nothing twice)."""
    seq = chunk.seq
    if not seq.params.prompt_logprobs:
        return range(0)
    return range(max(seq.prompt_logprobs_next, chunk.start + 1), min(seq.num_prompt_tokens, chunk.end + 1))


class ModelRunner:
    def __init__(
        self, model: LlamaModel, num_kv_blocks: int, block_size: int, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # what a constrained row may end with in an accepting state
        param = next(model.parameters())
        self.device = param.device
        c = model.config
        self.block_size = block_size
        self.kv = PagedKVCache.allocate(
            c.num_layers, num_kv_blocks, block_size, c.num_kv_heads, c.head_dim, param.dtype, self.device
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepOutput:
        """Forward the step's chunks; sample one token per sampling chunk, in batch order."""
        batch = build_forward_batch(out.chunks, self.block_size, self.device)
        # Prompt rows that score a prompt token get logits too, after the sampling rows.
        extra_rows: list[int] = []
        scored: list[tuple[ScheduledChunk, range]] = []
        row = 0
        for c in out.chunks:
            positions = _prompt_positions(c)
            if positions:
                extra_rows.extend(row + p - 1 - c.start for p in positions)
                scored.append((c, positions))
            row += c.num_tokens
        if extra_rows:
            extra = torch.tensor(extra_rows, dtype=torch.int64, device=self.device)
            batch = replace(batch, sample_rows=torch.cat([batch.sample_rows, extra]))
        logits = self.model(batch, self.kv)
        sampling = out.sampling_chunks
        step = StepOutput([], [])
        if sampling:
            step.tokens, step.logprobs = self._sample(sampling, logits[: len(sampling)])
        at = len(sampling)
        for c, positions in scored:
            rows = logits[at : at + len(positions)]
            at += len(positions)
            targets = torch.tensor([c.seq.token_ids[p] for p in positions], device=self.device)
            temperature = torch.full((len(positions),), c.seq.params.temperature, device=self.device)
            top_n = [c.seq.params.logprobs or 0] * len(positions)
            step.prompt_logprobs[c.seq.request_id] = token_logprobs(rows, temperature, targets, top_n)
        return step

    def _sample(
        self, sampling: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        st = SamplingTensors.build(
            [c.seq.params for c in sampling],
            [c.seq.seed for c in sampling],
            [c.seq.num_output_tokens for c in sampling],
            self.device,
        )
        if any(c.seq.params.penalized for c in sampling):
            logits = logits.clone()
            for row, c in enumerate(sampling):
                if c.seq.params.penalized:
                    seq = c.seq
                    penalize(
                        logits[row], seq.params, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
                    )
        logits = mask_constrained(logits, [c.seq for c in sampling], self.eos_token_ids)
        tokens = sample(logits, st)
        logprobs: list[TokenLogprobs | None] = [None] * len(sampling)
        wanting = [i for i, c in enumerate(sampling) if c.seq.params.logprobs is not None]
        if wanting:
            rows = torch.tensor(wanting, device=self.device)
            top_n = [sampling[i].seq.params.logprobs or 0 for i in wanting]
            for i, lp in zip(
                wanting, token_logprobs(logits[rows], st.temperature[rows], tokens[rows], top_n), strict=True
            ):
                logprobs[i] = lp
        return tokens.tolist(), logprobs
