"""Token sampling: greedy, or temperature -> top-k -> top-p -> min-p -> exponential race (docs/engine.md).

Every operation is row-wise, and the randomness comes from the counter-based `rng.uniforms`, so a row's
token depends only on its logits, its parameters, its seed and its output index: never on which other
rows share the batch or where the row sits in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blink_appliance.engine.reference.rng import row_keys, uniforms, uniforms_at
from blink_appliance.wire.request import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, as [R] tensors on the logits' device."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float32; 1 = off
    min_p: torch.Tensor  # float32; 0 = off
    seeds: torch.Tensor  # int64 in [0, 2**63)
    output_index: torch.Tensor  # int64: how many tokens the row's request generated before this one
    random_rows: list[int]  # rows with temperature > 0
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_index: list[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            output_index=torch.tensor(output_index, dtype=torch.int64, device=device),
            random_rows=[i for i, p in enumerate(params) if not p.greedy],
            use_top_k=any(p.top_k > 0 for p in params if not p.greedy),
            use_top_p=any(p.top_p < 1.0 for p in params if not p.greedy),
            use_min_p=any(p.min_p > 0.0 for p in params if not p.greedy),
        )


def filter_mask(
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """Which tokens survive top-k, then top-p, then min-p, on temperature-scaled logits x [R, V].

    - top-k (k > 0): keep x_i >= the k-th largest x of the row (ties at the threshold are all kept).
    - top-p (p < 1): over the survivors, in descending x order (ties: lower index first), with
      q_i = exp(x_i - logsumexp(survivors)), keep a token when the mass q of the survivors ranked
      before it is < p (so the top token always stays).
    - min-p (m > 0): keep x_i >= max(x) + log(m), i.e. q_i >= m * q_max.
    The row's maximum always survives.
    """
    vocab = x.shape[-1]
    keep = torch.ones_like(x, dtype=torch.bool)
    if use_top_k:
        on = (top_k > 0) & (top_k < vocab)
        if bool(on.any()):
            k = torch.where(on, top_k, 1)
            largest = x.topk(int(k.max()), dim=-1).values  # sorted, descending
            threshold = largest.gather(1, (k - 1)[:, None]).masked_fill_(~on[:, None], -math.inf)
            keep &= x >= threshold
    if use_top_p and bool((top_p < 1.0).any()):
        keep &= _top_p_keep(x.masked_fill(~keep, -math.inf), top_p)
    if use_min_p and bool((min_p > 0.0).any()):
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log 0 = -inf keeps all
        keep &= x >= threshold
    return keep


TOP_P_CANDIDATES = 256  # sort only this many first; the full sort runs when the nucleus may be larger


def _nucleus(sorted_x: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep flags for x sorted descending: the mass ranked before a token is < top_p."""
    probs = (sorted_x - lse).exp()
    before = probs.cumsum(dim=-1) - probs
    keep = before < top_p[:, None]
    keep[:, 0] = True
    return keep | (top_p >= 1.0)[:, None]


def _top_p_keep(masked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    vocab = masked.shape[-1]
    if vocab > TOP_P_CANDIDATES:
        vals, idx = masked.topk(TOP_P_CANDIDATES, dim=-1)
        by_index = idx.argsort(dim=-1)  # topk's order of equal values is unspecified: put lower ids first
        idx, vals = idx.gather(1, by_index), vals.gather(1, by_index)
        vals, order = vals.sort(dim=-1, descending=True, stable=True)
        idx = idx.gather(1, order)
        keep_sorted = _nucleus(vals, lse, top_p)
        n_kept = keep_sorted.sum(dim=-1)
        last_kept = vals.gather(1, (n_kept.clamp(max=TOP_P_CANDIDATES) - 1)[:, None])[:, 0]
        # Exact when the nucleus ends inside the candidates, strictly above the smallest candidate
        # (then no token outside them can tie into it).
        exact = ((n_kept < TOP_P_CANDIDATES) & (last_kept > vals[:, -1])) | (top_p >= 1.0)
        if bool(exact.all()):
            keep = torch.zeros_like(masked, dtype=torch.bool).scatter_(1, idx, keep_sorted)
            return keep | (top_p >= 1.0)[:, None]
    sorted_x, order = masked.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(masked, dtype=torch.bool).scatter_(1, order, _nucleus(sorted_x, lse, top_p))


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[R, V] float32 logits -> [R] int64 tokens."""
    tokens = logits.argmax(dim=-1)  # greedy rows; ties -> lowest index
    if not st.random_rows:
        return tokens
    rows = torch.tensor(st.random_rows, dtype=torch.int64, device=logits.device)
    x = logits[rows].to(torch.float32) / st.temperature[rows, None]
    keys = row_keys(st.seeds[rows], st.output_index[rows])
    # Exponential race: argmax p_i / E_i with E_i = -log(u_i), taken in log space (Gumbel-max).
    if not (st.use_top_k or st.use_top_p or st.use_min_p):
        u = uniforms(st.seeds[rows], st.output_index[rows], x.shape[-1])
        score = x - torch.log(-torch.log(u))
    else:
        keep = filter_mask(
            x,
            st.top_k[rows],
            st.top_p[rows],
            st.min_p[rows],
            use_top_k=st.use_top_k,
            use_top_p=st.use_top_p,
            use_min_p=st.use_min_p,
        )
        # The RNG is counter-based, so only the survivors need their uniforms.
        r, c = keep.nonzero(as_tuple=True)
        u = uniforms_at(keys[r], c)
        score = torch.full_like(x, -math.inf)
        score[r, c] = x[r, c] - torch.log(-torch.log(u))
    tokens[rows] = score.argmax(dim=-1)
    return tokens
