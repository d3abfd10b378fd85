"""Split-KV (flash-decoding) for kernels/paged_attention.py: the fp32 partials and their merge.

With NUM_SPLITS > 1 the attention cuts each program's key range into that many contiguous pieces and
writes each piece's result unnormalized (acc, running max, running sum) to fp32 partials;
`combine_splits` merges them into the output. A piece past the context may write only its max
(-inf), so the merge reads an accumulator only where the max is finite. Decode steps have few query
tokens and long key ranges; splitting puts more programs (more loads in flight) on the same bytes,
which is what a latency-bound loop needs.

Partials layout: acc [NUM_SPLITS, T, num_heads, head_dim], (m, l) [NUM_SPLITS, T, num_heads, 2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_splits_kernel(
    partial_acc_ptr,
    partial_ml_ptr,
    out_ptr,
    num_tokens,
    out_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sp = tl.arange(0, SPLITS_PAD)
    sp_in = sp < NUM_SPLITS
    row = (sp * num_tokens + t) * NUM_HEADS + h
    run_max = tl.load(partial_ml_ptr + row * 2, mask=sp_in, other=float("-inf"))
    run_sum = tl.load(partial_ml_ptr + row * 2 + 1, mask=sp_in, other=0.0)
    m_max = tl.max(run_max, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    # A split that saw no visible key for this row (max -inf) contributes nothing.
    w = tl.where(run_max == float("-inf"), 0.0, tl.math.exp2(run_max - m_max))
    d = tl.arange(0, HEAD_DIM)
    # A split past the context may have written only its max (-inf), so its accumulator is not read.
    seen = sp_in & (run_max != float("-inf"))
    acc = tl.load(partial_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=seen[:, None], other=0.0)
    total = tl.sum(w * run_sum, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * out_stride + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def split_partials(
    num_splits: int, num_tokens: int, num_heads: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for split-KV attention: (acc, (max, sum)) per split, token and head."""
    acc = torch.empty(num_splits * num_tokens * num_heads * head_dim, dtype=torch.float32, device=device)
    ml = torch.empty(num_splits * num_tokens * num_heads * 2, dtype=torch.float32, device=device)
    return acc, ml


def checked_partials(
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    num_splits: int,
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials a split launch writes: `partials` checked for size and dtype, or fresh ones."""
    if partials is None:
        partials = split_partials(num_splits, num_tokens, num_heads, head_dim, device)
    acc_buf, ml_buf = partials
    if (
        acc_buf.numel() < num_splits * num_tokens * num_heads * head_dim
        or ml_buf.numel() < num_splits * num_tokens * num_heads * 2
    ):
        raise ValueError("paged_attention: partials too small for this split count and T")
    if acc_buf.dtype != torch.float32 or ml_buf.dtype != torch.float32:
        raise ValueError("paged_attention: partials must be fp32")
    return acc_buf, ml_buf


def combine_splits(
    acc_buf: torch.Tensor,
    ml_buf: torch.Tensor,
    out: torch.Tensor,
    tokens: int,
    num_heads: int,
    head_dim: int,
    num_splits: int,
    pdl: bool,
) -> None:
    """Merge the split partials of the first `tokens` rows of `out` [>= T, num_heads * head_dim] into it."""
    _combine_splits_kernel[(tokens, num_heads)](
        acc_buf,
        ml_buf,
        out,
        tokens,
        out.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        USE_PDL=pdl,
        num_warps=1 if head_dim <= 64 else 2,
        launch_pdl=pdl,
    )
