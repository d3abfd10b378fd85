"""Causal paged attention over a flat batch that mixes prefill chunks and decode tokens, with GQA.

Layout and metadata as docs/kv_layout.md: the batch holds T query tokens; sequence s owns the run
`query_start[s] : query_start[s+1]` and, after this step's cache writes, `context_lens[s]` keys in the
blocks `block_tables[s]`. Token t of s sits at position `context_lens[s] - (query_start[s+1] - t)` and
sees keys 0..that position.

Work split: a program takes up to BLOCK_Q consecutive query tokens of one sequence and one KV head,
with that head's whole GQA group stacked into the tile's rows (BLOCK_Q * group rows), so each K/V tile
it loads serves every query head that shares it. The grid has a fixed size for a fixed T and max_seqs
(no host look at the metadata): program p finds its sequence as the last s with
`query_start[s] // BLOCK_Q + s <= p` (this numbering gives each sequence at least as many programs as
it has query blocks). Index S (one past the last sequence) stands for the padding rows from
`query_start[S]` to T; they have no keys and are written as zeros, so every output row is written.
Online softmax in fp32; keys are gathered per token through the block table, so the key tile need not
match the cache block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_tables_ptr,
    num_tokens,
    num_seqs,
    q_stride,
    out_stride,
    block_table_stride,
    qk_scale_log2,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence (or the padding tail, index num_seqs) this program serves.
    s_idx = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_ptr + s_idx, mask=s_idx <= num_seqs, other=0)
    first_block = starts // BLOCK_Q + s_idx
    seq = tl.sum(((first_block <= pid) & (s_idx <= num_seqs)).to(tl.int32), axis=0) - 1
    is_seq = seq < num_seqs
    seq_start = tl.load(query_start_ptr + seq)
    seq_end = tl.load(query_start_ptr + seq + 1, mask=is_seq, other=num_tokens)
    ctx = tl.load(context_lens_ptr + seq, mask=is_seq, other=0)
    t0 = seq_start + (pid - (seq_start // BLOCK_Q + seq)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (tok < seq_end) & (g < GROUP)
    head = kv_head * GROUP + g
    q_pos = ctx - (seq_end - tok)  # row's position; causal bound for its keys
    t_last = tl.minimum(t0 + BLOCK_Q, seq_end) - 1
    kv_end = tl.where(t0 < seq_end, ctx - (seq_end - 1 - t_last), 0)

    d = tl.arange(0, HEAD_DIM)
    tok64 = tok.to(tl.int64)
    q = tl.load(
        q_ptr + tok64[:, None] * q_stride + head[:, None] * HEAD_DIM + d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    slot_stride = NUM_KV_HEADS * HEAD_DIM
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_in = k_pos < kv_end
        blk = tl.load(table + k_pos // BLOCK_SIZE, mask=k_in, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        kv_off = slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=k_in[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=k_in[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_in[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows that have seen no visible key yet keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok64[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def attention_grid(num_tokens: int, max_seqs: int, block_q: int, num_kv_heads: int) -> tuple[int, int]:
    """Programs for a fixed (T, max_seqs): enough for any split of T tokens over max_seqs sequences."""
    return (triton.cdiv(num_tokens, block_q) + max_seqs + 1, num_kv_heads)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    block_q: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q: [T, >= num_heads*head_dim] (row stride free, e.g. the q part of a fused QKV buffer);
    k_cache/v_cache: one layer, [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
    out: [T, num_heads*head_dim]; query_start [S+1], context_lens [S], block_tables [S, B] int32.
    Every row of out is written (padding rows past query_start[S] get zeros).
    """
    tokens = q.shape[0]
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: {num_heads} heads do not split over {num_kv_heads} KV heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged_attention: head_dim {head_dim} must be a power of two >= 16")
    if query_start.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("paged_attention: query_start must be [S+1] and block_tables [S, B]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the cache layer views must be contiguous")
    if q.stride(1) != 1 or out.stride(1) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_attention: q, out and block_tables must be row-major")
    if tokens == 0:
        return out
    group_pad = triton.next_power_of_2(group)
    # tl.dot needs at least 16 rows; stack more query tokens when the group is small.
    block_q = max(block_q, triton.cdiv(16, group_pad))
    block_q = triton.next_power_of_2(block_q)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = attention_grid(tokens, num_seqs, block_q, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start,
        context_lens,
        block_tables,
        tokens,
        num_seqs,
        q.stride(0),
        out.stride(0),
        block_tables.stride(0),
        scale * _LOG2E,
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SEQS_PAD=triton.next_power_of_2(num_seqs + 1),
        DOT_PRECISION=dot_precision,
        num_warps=4,
    )
    return out
