"""Split-KV (flash-decoding) for kernels/paged_attention.py: the fp32 partials and their merge.

With NUM_SPLITS > 1 the attention cuts each program's key range into that many contiguous pieces and
writes each piece's result unnormalized (acc, running max, running sum) to fp32 partials;
`combine_splits` merges them into the output, reading only the pieces that saw keys: a piece past the
context may write nothing. Decode steps have few query tokens and long key ranges; splitting puts more
programs (more loads in flight) on the same bytes, which is what a latency-bound loop needs.

Partials layout: acc [NUM_SPLITS, T, num_heads, head_dim], (m, l) [NUM_SPLITS, T, num_heads, 2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_runs(query_start_ptr, context_lens_ptr, num_seqs, num_tokens, SEQS_PAD: tl.constexpr):
    """The step's run table as vectors over sequence slots: each slot's first row, end row and context
    length. Slot num_seqs is the padding tail (rows query_start[num_seqs] up to num_tokens, no keys)."""
    s_idx = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_ptr + s_idx, mask=s_idx <= num_seqs, other=num_tokens)
    ends = tl.load(query_start_ptr + s_idx + 1, mask=s_idx < num_seqs, other=num_tokens)
    ctxs = tl.load(context_lens_ptr + s_idx, mask=s_idx < num_seqs, other=0)
    return s_idx, starts, ends, ctxs


@triton.jit
def pick(sel, values):
    """The value where `sel` holds (0 where it holds nowhere): picked out of registers, no load."""
    return tl.sum(tl.where(sel, values, 0), axis=0)


@triton.jit
def block_key_end(ctx, t0, seq_end, BLOCK_Q: tl.constexpr):
    """The keys a query block attends to: [0, this), up to its last token's position. ctx is its
    sequence's context length, t0 its first token, seq_end the end of its sequence's rows."""
    t_last = tl.minimum(t0 + BLOCK_Q, seq_end) - 1
    return tl.where(t0 < seq_end, ctx - (seq_end - 1 - t_last), 0)


@triton.jit
def split_key_len(kv_end, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys a split takes of [0, kv_end), in whole key tiles: split i takes [i * this, (i + 1) * this)."""
    return tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _combine_splits_kernel(
    partial_acc_ptr,
    partial_ml_ptr,
    out_ptr,
    query_start_ptr,
    context_lens_ptr,
    num_tokens,
    num_seqs,
    out_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # Which splits saw keys follows from the step's inputs alone, so it is known before the wait and
    # the partials load in one round trip, only the splits that wrote them (a split past the context
    # writes nothing).
    _, starts, ends, ctxs = load_runs(query_start_ptr, context_lens_ptr, num_seqs, num_tokens, SEQS_PAD)
    mine = (starts <= t) & (
        t < ends
    )  # a padding row falls in the tail, which has no keys: it merges to zeros
    seq_start = pick(mine, starts)
    t0 = seq_start + (t - seq_start) // BLOCK_Q * BLOCK_Q
    kv_end = block_key_end(pick(mine, ctxs), t0, pick(mine, ends), BLOCK_Q)
    # (tl.where computes both sides: the maximum only keeps the unused one from dividing by zero.)
    seen_splits = tl.where(
        kv_end > 0, tl.cdiv(kv_end, tl.maximum(split_key_len(kv_end, NUM_SPLITS, BLOCK_N), 1)), 0
    )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sp = tl.arange(0, SPLITS_PAD)
    seen = sp < tl.minimum(seen_splits, NUM_SPLITS)
    row = (sp * num_tokens + t.to(tl.int64)) * NUM_HEADS + h
    run_max = tl.load(partial_ml_ptr + row * 2, mask=seen, other=float("-inf"))
    run_sum = tl.load(partial_ml_ptr + row * 2 + 1, mask=seen, other=0.0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(partial_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=seen[:, None], other=0.0)
    m_max = tl.max(run_max, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    # A row of a split that saw no visible key for it (max -inf) contributes nothing.
    w = tl.where(run_max == float("-inf"), 0.0, tl.math.exp2(run_max - m_max))
    total = tl.sum(w * run_sum, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + h * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


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
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    tokens: int,
    num_heads: int,
    head_dim: int,
    num_splits: int,
    block_q: int,
    block_n: int,
    pdl: bool,
) -> None:
    """Merge the split partials of the first `tokens` rows of `out` [>= T, num_heads * head_dim] into it;
    query_start, context_lens, block_q and block_n as the attention launch had them, which say the
    splits that saw keys."""
    num_seqs = context_lens.shape[0]
    _combine_splits_kernel[(tokens, num_heads)](
        acc_buf,
        ml_buf,
        out,
        query_start,
        context_lens,
        tokens,
        num_seqs,
        out.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SEQS_PAD=triton.next_power_of_2(num_seqs + 1),
        USE_PDL=pdl,
        num_warps=1 if head_dim <= 64 else 2,
        launch_pdl=pdl,
    )
