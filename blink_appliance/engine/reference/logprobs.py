"""Log-probabilities of chosen tokens and of the most likely alternatives (docs/api.md, "Logprobs").

The distribution is the one the sampler draws from before top-k / top-p / min-p cut it: the model's
logits divided by the request's temperature (greedy rows: by 1), through a log-softmax in fp32. The
N most likely come in descending order, ties broken by the lower token id.
"""

from __future__ import annotations

import torch

from blink_appliance.wire.request import TokenLogprobs


def scaled_log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[R, V] logits and [R] temperatures (0 = greedy, taken as 1) -> [R, V] fp32 log-probabilities."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    return torch.log_softmax(logits.to(torch.float32) / t[:, None], dim=-1)


def top_tokens(logprobs: torch.Tensor, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per row, the `n` largest entries' ids and values: descending, ties by lower id."""
    if n == 0:
        return [[] for _ in range(logprobs.shape[0])], [[] for _ in range(logprobs.shape[0])]
    floor = logprobs.topk(n, dim=-1).values[:, -1:]
    ids_out, vals_out = [], []
    for row, threshold in zip(logprobs, floor, strict=True):
        ids = (row >= threshold).nonzero()[:, 0]  # ascending ids, ties at the n-th value included
        order = row[ids].argsort(descending=True, stable=True)[:n]
        ids_out.append(ids[order].tolist())
        vals_out.append(row[ids[order]].tolist())
    return ids_out, vals_out


def token_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor, top_n: list[int]
) -> list[TokenLogprobs]:
    """Each row's `tokens[r]` with its log-probability and the row's `top_n[r]` most likely tokens."""
    lp = scaled_log_softmax(logits, temperature)
    chosen = lp.gather(1, tokens.to(torch.int64)[:, None])[:, 0].tolist()
    ids, vals = top_tokens(lp, max(top_n, default=0))
    return [
        TokenLogprobs(int(t), c, tuple(zip(i[:n], v[:n], strict=True)))
        for t, c, i, v, n in zip(tokens.tolist(), chosen, ids, vals, top_n, strict=True)
    ]
