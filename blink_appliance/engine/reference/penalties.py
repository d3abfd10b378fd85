"""Penalties and logit biases: what a request's own tokens and its logit_bias do to its logits
before temperature, sampling and logprobs (docs/engine.md, "Penalties"), in this order:

1. logit_bias: x[t] += bias for each listed token;
2. repetition (r != 1), over the distinct tokens of the prompt and the generated ones, as
   transformers' RepetitionPenaltyLogitsProcessor: x / r where x > 0, else x * r;
3. frequency f and presence p, over the generated tokens (OpenAI's definition):
   x[t] -= f * count(t) + p * (count(t) > 0), the product and the sum in fp32.
"""

from __future__ import annotations

import torch

from blink_appliance.wire.request import SamplingParams


def penalize(x: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]) -> None:
    """Apply one row's biases and penalties to its fp32 logits `x` [V], in place."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=x.device)
        x.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=x.dtype, device=x.device))
    r = params.repetition_penalty
    if r != 1.0 and (prompt or generated):
        ids = torch.tensor(prompt + generated, dtype=torch.int64, device=x.device).unique()
        seen = x[ids]
        x[ids] = torch.where(
            seen > 0, seen / torch.tensor(r, dtype=x.dtype), seen * torch.tensor(r, dtype=x.dtype)
        )
    f, p = params.frequency_penalty, params.presence_penalty
    if (f or p) and generated:
        ids, counts = torch.tensor(generated, dtype=torch.int64, device=x.device).unique(return_counts=True)
        f32 = torch.float32
        x[ids] -= torch.tensor(f, dtype=f32) * counts.to(f32) + torch.tensor(p, dtype=f32)
