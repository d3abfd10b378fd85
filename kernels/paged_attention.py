"""Causal paged attention over a flat batch that mixes prefill chunks and decode tokens, with GQA.

Layout and metadata as docs/kv_layout.md: the batch holds T query tokens; sequence s owns the run
`query_start[s] : query_start[s+1]` and, after this step's cache writes, `context_lens[s]` keys in the
blocks `block_tables[s]`. Token t of s sits at position `context_lens[s] - (query_start[s+1] - t)` and
sees keys 0..that position.

Work split: a program takes up to BLOCK_Q consecutive query tokens of one sequence and one KV head,
with that head's whole GQA group stacked into the tile's rows (BLOCK_Q * group rows), so each K/V tile
it loads serves every query head that shares it. The grid has a fixed size for a fixed T and max_seqs
(no host look at the metadata): program p finds its sequence as the last non-empty s with
`query_start[s] // BLOCK_Q + rank(s) <= p`, rank(s) counting the non-empty runs before s (this
numbering gives each run at least as many programs as it has query blocks, and empty sequence slots
none, so the grid is cdiv(T, BLOCK_Q) + min(T, S) + 1). Index S (one past the last sequence) stands
for the padding rows from `query_start[S]` to T; they have no keys and are written as zeros, so every
output row is written.
Online softmax in fp32; keys are gathered per token through the block table, so the key tile need not
match the cache block size.

Split-KV (flash-decoding): with NUM_SPLITS > 1 a third grid axis cuts each program's key range into
that many contiguous pieces, each written unnormalized (acc, running max, running sum) to fp32 partials
that kernels/split_kv.py merges. With fused RoPE, a piece past the context (most of them, for a short
one) writes nothing and ends.

Fused RoPE (`FusedRope`): the kernel then also does kernels/rope.py's work, so the step has one kernel
fewer per layer. q is read from the QKV output (or the sum of its split-K partials) and rotated as it
is loaded. Before its key loop, each program takes the keys this step adds (positions from
context_lens[s] - run length on) that fall in its key range from the QKV output, rotates them, writes
them and their values to their slots `slot_mapping[t]`, and passes a CTA barrier; the loop then reads
them through the cache with the older keys. A prefill chunk's key is written by every program whose
queries see it, always the same bits, so concurrent duplicate writes are harmless; no other slot of
the cache is written. Doing this before the loop costs one memory round trip per program; doing it
after, or holding the new keys in registers across the loop, measured slower
(bench/results/2026-11-25-h100-forward-fused-rope.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from blink_appliance.kernels.rope import join_halves, qkv_tile, rope_at, rope_halves
from blink_appliance.kernels.split_kv import (
    block_key_end,
    checked_partials,
    combine_splits,
    load_runs,
    pick,
    split_key_len,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, k, v, k_pos, k_in, q_pos, m_i, l_i, acc, qk_scale_log2, DOT_PRECISION: tl.constexpr):
    """One key tile into the query tile's online softmax (fp32): returns the new (max, sum, acc)."""
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
    return m_new, l_i, acc


@triton.jit
def _attend_cached(
    q, q_pos, m_i, l_i, acc, blk, lo, hi, table, k_cache_ptr, v_cache_ptr, kv_head, qk_scale_log2,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Keys lo..hi-1 from the cache, BLOCK_N at a time, into the online softmax. `blk`: the block ids
    of the first tile, fetched by the caller (before the PDL wait); each tile fetches the next's."""
    d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_in = k_pos < hi
        slot = blk.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        next_pos = k_pos + BLOCK_N
        blk = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < hi, other=0)
        kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=k_in[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=k_in[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, k_pos, k_in, q_pos, m_i, l_i, acc, qk_scale_log2, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _qkv_rows(
    qkv_ptr, parts_ptr, bias_ptr, tok, mask, cols, qkv_stride, part_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Columns `cols` [n, w] of the QKV output's rows `tok` [n] (fused RoPE)."""
    width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return qkv_tile(qkv_ptr + tok[:, None] * qkv_stride, parts_ptr + tok[:, None] * width, bias_ptr, cols,
                    mask[:, None], part_stride, PARTS, HAS_BIAS)  # fmt: skip


@triton.jit
def _fresh_kv(
    qkv_ptr, parts_ptr, bias_ptr, tok, mask, pos, cos_ptr, sin_ptr, max_positions, kv_head, qkv_stride, part_stride,
    cache_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """This step's keys (rotated to positions `pos`) and values of one KV head for tokens `tok`, from
    the QKV output, rounded to the cache's dtype: the values kernels/rope.py would write to the cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HALF)[None, :]
    k_col = (NUM_HEADS + kv_head) * HEAD_DIM
    v_col = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
    k1 = _qkv_rows(qkv_ptr, parts_ptr, bias_ptr, tok, mask, k_col + h, qkv_stride, part_stride,
                   NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS, HAS_BIAS)  # fmt: skip
    k2 = _qkv_rows(qkv_ptr, parts_ptr, bias_ptr, tok, mask, k_col + HALF + h, qkv_stride, part_stride,
                   NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS, HAS_BIAS)  # fmt: skip
    cos, sin = rope_at(cos_ptr, sin_ptr, pos, max_positions, HEAD_DIM)
    k1, k2 = rope_halves(k1, k2, cos, sin)
    cdt = cache_ptr.dtype.element_ty
    k = join_halves(k1.to(cdt), k2.to(cdt))
    v = _qkv_rows(qkv_ptr, parts_ptr, bias_ptr, tok, mask, v_col + tl.arange(0, HEAD_DIM)[None, :], qkv_stride,
                  part_stride, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS, HAS_BIAS)  # fmt: skip
    return k, v.to(cdt)


@triton.jit
def _store_result(
    out_ptr, partial_acc_ptr, partial_ml_ptr, acc, m_i, l_i, tok64, head, row_valid, split, num_tokens,
    out_stride,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """The program's epilogue: its rows normalized into out, or (split-KV) unnormalized into the
    partials: acc [NUM_SPLITS, T, num_heads, HEAD_DIM], (m, l) [NUM_SPLITS, T, num_heads, 2]."""
    d = tl.arange(0, HEAD_DIM)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok64[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        row = (split * num_tokens + tok64) * NUM_HEADS + head
        tl.store(partial_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_valid[:, None])
        tl.store(partial_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(partial_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_ml_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_tables_ptr,
    num_tokens,
    num_seqs,
    q_stride,
    out_stride,
    block_table_stride,
    qk_scale_log2,
    parts_ptr,
    bias_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    part_stride,
    max_positions,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    FUSED_ROPE: tl.constexpr = False,
    PARTS: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    NUM_HEADS: tl.constexpr = NUM_KV_HEADS * GROUP
    FRESH_N: tl.constexpr = 16  # this step's keys rotated per pass (fused RoPE): small tiles, few registers
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence (or the padding tail, index num_seqs) this program serves. Non-empty runs are
    # numbered query_start[s] // BLOCK_Q + (non-empty runs before s): enough programs for each run's
    # query blocks, and empty sequence slots cost no programs.
    s_idx, starts, ends, ctxs = load_runs(query_start_ptr, context_lens_ptr, num_seqs, num_tokens, SEQS_PAD)
    nonempty = (ends > starts) & (s_idx <= num_seqs)
    ne = nonempty.to(tl.int32)
    rank = tl.cumsum(ne, axis=0) - ne
    first_block = starts // BLOCK_Q + rank
    seq = tl.max(tl.where(nonempty & (first_block <= pid), s_idx, -1), axis=0)
    seq = tl.maximum(seq, 0)  # only when T == 0 or the grid overshoots; then t0 >= seq_end below
    # Pick this sequence's facts out of vectors already in registers: no dependent loads (a decode
    # program is a short chain of memory round trips, so each one saved shows).
    sel = s_idx == seq
    seq_first_block = pick(sel, first_block)
    seq_start = pick(sel, starts)
    seq_end = pick(sel, ends)  # num_tokens for the padding tail
    ctx = pick(sel, ctxs)  # 0 for the padding tail
    t0 = seq_start + (pid - seq_first_block) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_valid = (tok < seq_end) & (g < GROUP)
    head = kv_head * GROUP + g
    q_pos = ctx - (seq_end - tok)  # row's position; causal bound for its keys
    kv_end = block_key_end(ctx, t0, seq_end, BLOCK_Q)

    d = tl.arange(0, HEAD_DIM)
    tok64 = tok.to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    # This split's slice of the key range, in whole key tiles.
    split_len = split_key_len(kv_end, NUM_SPLITS, BLOCK_N)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)
    if FUSED_ROPE:
        # Keys below ctx_old are in the cache already; this step's keys (ctx_old and up) come from
        # qkv and are written there before the key loop.
        ctx_old = ctx - (seq_end - seq_start)
        fresh_lo = tl.maximum(kv_lo, ctx_old)
        q_cos, q_sin = rope_at(cos_ptr, sin_ptr, q_pos, max_positions, HEAD_DIM)
    # Block ids are fetched one tile ahead, so a tile's K/V loads do not wait on a block-table load.
    next_pos = kv_lo + tl.arange(0, BLOCK_N)
    blk = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < kv_hi, other=0)
    if USE_PDL:  # launched early: the metadata above are step inputs; q and this step's K/V are not
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # A split past the context (a short one leaves most of them so) ends here and writes nothing: the
    # merge does not read it. It ends after the wait, so every program waits (ending before it measured
    # the same). Only programs that fuse RoPE (the 1- to 4-token buckets, where it was measured) end
    # early: the plain 1-warp programs of the 8-token bucket would need more registers for it (80 -> 96,
    # bench/kernel_registers.py).
    if NUM_SPLITS > 1 and FUSED_ROPE:
        if kv_lo >= kv_hi:
            return
    if FUSED_ROPE:
        h = tl.arange(0, HEAD_DIM // 2)[None, :]
        q_col = head[:, None] * HEAD_DIM
        q1 = _qkv_rows(q_ptr, parts_ptr, bias_ptr, tok64, row_valid, q_col + h, q_stride, part_stride,
                       NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS, HAS_BIAS)  # fmt: skip
        q2 = _qkv_rows(q_ptr, parts_ptr, bias_ptr, tok64, row_valid, q_col + HEAD_DIM // 2 + h, q_stride,
                       part_stride, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS, HAS_BIAS)  # fmt: skip
        q1r, q2r = rope_halves(q1, q2, q_cos, q_sin)
        q = join_halves(q1r.to(q1.dtype), q2r.to(q1.dtype))
    else:
        q = tl.load(
            q_ptr + tok64[:, None] * q_stride + head[:, None] * HEAD_DIM + d[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )
    if FUSED_ROPE:
        # This step's keys in this split's range: rotated from the QKV output and written to their
        # slots (a prefill chunk's key by every program whose queries see it: the same bits), then
        # read back through the cache like the others. Before the loop it costs one memory round
        # trip (after it, four in a row, while memory is busiest); small tiles only, so the kernel
        # keeps the plain one's occupancy (80 registers at 33-128 tokens, bench/kernel_registers.py).
        for start in range(fresh_lo, kv_hi, FRESH_N):
            k_pos = start + tl.arange(0, FRESH_N)
            k_in = k_pos < kv_hi
            k_tok = (seq_start + k_pos - ctx_old).to(tl.int64)
            slot = tl.load(slot_ptr + k_tok, mask=k_in, other=-1)
            k, v = _fresh_kv(q_ptr, parts_ptr, bias_ptr, k_tok, k_in, k_pos, cos_ptr, sin_ptr, max_positions,
                             kv_head, q_stride, part_stride, k_cache_ptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTS,
                             HAS_BIAS)  # fmt: skip
            w = (k_in & (slot >= 0))[:, None]
            c_off = tl.maximum(slot, 0)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
            tl.store(k_cache_ptr + c_off, k, mask=w)
            tl.store(v_cache_ptr + c_off, v, mask=w)
        tl.debug_barrier()  # the program's cache writes, visible to all its threads
    m_i, l_i, acc = _attend_cached(q, q_pos, m_i, l_i, acc, blk, kv_lo, kv_hi, table, k_cache_ptr, v_cache_ptr,
                                   kv_head, qk_scale_log2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
                                   DOT_PRECISION)  # fmt: skip
    _store_result(out_ptr, partial_acc_ptr, partial_ml_ptr, acc, m_i, l_i, tok64, head, row_valid, split,
                  num_tokens, out_stride, NUM_HEADS, HEAD_DIM, NUM_SPLITS)  # fmt: skip


@dataclass(frozen=True)
class FusedRope:
    """What the attention needs to do kernels/rope.py's work itself (see the module docstring).
    slot_mapping: [T] int64; cos, sin: [max_positions, head_dim // 2] fp32 (`rope_tables`);
    qkv_parts: the QKV GEMM's split-K partials [P, T, (Hq + 2*Hkv) * head_dim] contiguous (fp32 or
    qkv's dtype), summed here, with qkv_bias, instead of reading qkv. No per-head q/k norm (Qwen3):
    those models take the separate RoPE kernel. Tokens are rotated to the positions the attention
    derives from the metadata (context_lens[s] - (query_start[s+1] - t), what `positions` holds by
    docs/kv_layout.md), so no positions tensor is read."""

    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    qkv_parts: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def check(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        tokens, width = qkv.shape[0], (num_heads + 2 * num_kv_heads) * head_dim
        if qkv.shape[1] != width:
            raise ValueError(f"paged_attention: with FusedRope q must be the whole QKV output [T, {width}]")
        if self.slot_mapping.shape[0] < tokens:
            raise ValueError("paged_attention: slot_mapping needs a row per token")
        if self.cos.shape != self.sin.shape or self.cos.shape[1] != head_dim // 2:
            raise ValueError(f"paged_attention: cos/sin must be [max_positions, {head_dim // 2}]")
        parts = self.qkv_parts
        if parts is not None and (
            parts.dtype not in (torch.float32, qkv.dtype) or parts.shape[1:] != (tokens, width)
            or not parts.is_contiguous()
        ):  # fmt: skip
            raise ValueError(
                f"paged_attention: qkv_parts {tuple(parts.shape)} {parts.dtype} must be fp32 (or qkv's dtype) "
                f"[P, {tokens}, {width}]"
            )
        if self.qkv_bias is not None and parts is None:
            raise ValueError("paged_attention: qkv_bias goes with qkv_parts (a one-piece GEMM adds its own)")


def attention_grid(num_tokens: int, max_seqs: int, block_q: int, num_kv_heads: int) -> tuple[int, int]:
    """Programs for a fixed (T, max_seqs): enough for any split of T tokens over max_seqs sequences.
    The last run (a sequence or the padding tail) ends at T, so its last program is at most
    cdiv(T, block_q) - 1 plus the runs before it, and at most min(T, max_seqs + 1) runs are non-empty;
    at T = 1 that is one program, where idle ones would each still read the run table."""
    return (triton.cdiv(num_tokens, block_q) + min(num_tokens, max_seqs + 1) - 1, num_kv_heads)


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
    num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    pdl: bool = False,
    rope: FusedRope | None = None,
) -> torch.Tensor:
    """q: [T, >= num_heads*head_dim] (row stride free, e.g. the q part of a fused QKV buffer);
    k_cache/v_cache: one layer, [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
    out: [T, num_heads*head_dim]; query_start [S+1], context_lens [S], block_tables [S, B] int32.
    Every row of out is written (padding rows past query_start[S] get zeros).
    num_splits > 1 splits every key range (flash-decoding) and merges through `partials`: fp32 buffers
    with at least num_splits*T*num_heads*head_dim and num_splits*T*num_heads*2 elements
    (kernels/split_kv.py's `split_partials` allocates them; a captured step passes preallocated ones).
    rope: do RoPE and this step's cache writes here (kernels/rope.py's `rope_and_cache_write` is then
    not run): q is the whole QKV output [T, (Hq + 2*Hkv) * head_dim] (or stands for the split-K
    partials in `rope.qkv_parts`), rotated as it is read, and the cache receives this step's K/V.
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
    if rope is not None:
        rope.check(q, num_heads, num_kv_heads, head_dim)
    if tokens == 0:
        return out
    group_pad = triton.next_power_of_2(group)
    # tl.dot needs at least 16 rows; stack more query tokens when the group is small.
    block_q = max(block_q, triton.cdiv(16, group_pad))
    block_q = triton.next_power_of_2(block_q)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_splits < 1:
        raise ValueError(f"paged_attention: num_splits must be >= 1, got {num_splits}")
    if num_splits > 1:
        acc_buf, ml_buf = checked_partials(partials, num_splits, tokens, num_heads, head_dim, q.device)
    else:
        acc_buf = ml_buf = out
    grid = attention_grid(tokens, num_seqs, block_q, num_kv_heads) + (num_splits,)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        acc_buf,
        ml_buf,
        query_start,
        context_lens,
        block_tables,
        tokens,
        num_seqs,
        q.stride(0),
        out.stride(0),
        block_tables.stride(0),
        scale * _LOG2E,
        *_rope_args(rope, q),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SEQS_PAD=triton.next_power_of_2(num_seqs + 1),
        DOT_PRECISION=dot_precision,
        NUM_SPLITS=num_splits,
        USE_PDL=pdl,
        FUSED_ROPE=rope is not None,
        PARTS=0 if rope is None or rope.qkv_parts is None else rope.qkv_parts.shape[0],
        HAS_BIAS=rope is not None and rope.qkv_bias is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        combine_splits(
            acc_buf, ml_buf, out, query_start, context_lens, tokens=tokens, num_heads=num_heads,
            head_dim=head_dim, num_splits=num_splits, block_q=block_q, block_n=block_n, pdl=pdl,
        )  # fmt: skip
    return out


def _rope_args(rope: FusedRope | None, q: torch.Tensor) -> tuple:
    """The kernel's fused-RoPE arguments (placeholders, never read, without it)."""
    if rope is None:
        return (q, q, q, q, q, 0, 1)
    parts = rope.qkv_parts if rope.qkv_parts is not None else rope.cos
    bias = rope.qkv_bias if rope.qkv_bias is not None else rope.cos
    tokens, width = q.shape
    return (
        parts,
        bias,
        rope.slot_mapping,
        rope.cos,
        rope.sin,
        tokens * width,
        rope.cos.shape[0],
    )
