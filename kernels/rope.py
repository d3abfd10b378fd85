"""RoPE on q and k (rotate-half convention), fused with the paged KV-cache write.

The QKV projection leaves each token's row as [q heads | k heads | v heads]. One program per token
rotates the q heads in place (attention reads them straight from that buffer), rotates the k heads,
and stores k and v into the cache slot `slot_mapping[t]` (skipped when -1: padding). Or the row comes
as the split-K GEMM's fp32 partials (`qkv_parts`, plus the bias if any): summed here and rounded as a
one-piece GEMM would round them; then only the q part of `qkv` is written (the rotated q). Optional
per-head RMSNorm of q and k before the rotation (Qwen3). cos/sin come from tables precomputed at load
time (`rope_tables`), Llama-3 frequency scaling included, so the step does no trigonometry.

`qkv_tile`, `rope_at`, `rope_halves` and `join_halves` are shared with kernels/paged_attention.py,
which can do this kernel's work itself (its `FusedRope`): rotate q and the step's new keys as it loads
them from the QKV output, and write the keys and values to the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_tables(
    inv_freq: torch.Tensor, max_positions: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim // 2] fp32, computed as the reference model computes them."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    return freqs.cos().contiguous(), freqs.sin().contiguous()


@triton.jit
def _head_rms(x1, x2, w_ptr, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm of a [heads, HALF] x 2 tile, in the reference's order of roundings."""
    d = tl.arange(0, HALF)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    ms = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM
    rstd = 1.0 / tl.sqrt(ms + eps)
    w1 = tl.load(w_ptr + d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    a = (a * rstd[:, None]).to(x1.dtype).to(tl.float32) * w1[None, :]
    b = (b * rstd[:, None]).to(x2.dtype).to(tl.float32) * w2[None, :]
    return a.to(x1.dtype).to(tl.float32), b.to(x2.dtype).to(tl.float32)


@triton.jit
def qkv_tile(row, part_row, bias_ptr, off, mask, part_stride, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A tile of QKV output at `row + off` (row: one token's row, or a column of row pointers): from
    qkv, or the sum in fp32 of the PARTS partials (+ bias) rounded to qkv's dtype, as a one-piece GEMM
    would round it."""
    if PARTS == 0:
        return tl.load(row + off, mask=mask, other=0.0)
    acc = tl.load(part_row + off, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(part_row + p * part_stride + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + off, mask=mask, other=0.0).to(tl.float32)
    return acc.to(row.dtype.element_ty)


@triton.jit
def rope_at(cos_ptr, sin_ptr, pos, max_positions, HEAD_DIM: tl.constexpr):
    """cos and sin [len(pos), HEAD_DIM // 2] fp32 at positions `pos`."""
    HALF: tl.constexpr = HEAD_DIM // 2
    # An out-of-table position is a scheduler bug; clamp so it cannot fault (the host checks bounds).
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    off = pos[:, None] * HALF + tl.arange(0, HALF)[None, :]
    return tl.load(cos_ptr + off), tl.load(sin_ptr + off)


@triton.jit
def rope_halves(x1, x2, cos, sin):
    """Rotate-half RoPE in fp32 of rows split into halves [a | b]: (a*cos - b*sin, b*cos + a*sin)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def join_halves(x1, x2):
    """[n, h] and [n, h] -> [n, 2h]: the halves side by side again."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (x1.shape[0], 2 * x1.shape[1]))


@triton.jit
def _rope_cache_write_kernel(
    qkv_ptr,
    parts_ptr,
    bias_ptr,
    positions_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    qkv_stride,
    part_stride,
    max_positions,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_NORM: tl.constexpr,
    PARTS: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * qkv_stride
    part_row = parts_ptr + t * ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    pos = tl.load(positions_ptr + t)
    # An out-of-table position is a scheduler bug; clamp so it cannot fault (the host checks bounds).
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + d)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + d)[None, :]
    if USE_PDL:  # launched early: positions and tables are step inputs; qkv comes from the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # q heads, rotated in place.
    hq = tl.arange(0, HQ_PAD)[:, None]
    qmask = hq < NUM_HEADS
    q_off = hq * HEAD_DIM + d[None, :]
    q1 = qkv_tile(row, part_row, bias_ptr, q_off, qmask, part_stride, PARTS, HAS_BIAS)
    q2 = qkv_tile(row, part_row, bias_ptr, q_off + HALF, qmask, part_stride, PARTS, HAS_BIAS)
    if QK_NORM:
        a, b = _head_rms(q1, q2, q_norm_ptr, eps, HALF, HEAD_DIM)
    else:
        a = q1.to(tl.float32)
        b = q2.to(tl.float32)
    r1, r2 = rope_halves(a, b, cos, sin)
    tl.store(row + q_off, r1.to(q1.dtype), mask=qmask)
    tl.store(row + q_off + HALF, r2.to(q1.dtype), mask=qmask)

    # k heads rotated, k and v stored into the cache slot.
    slot = tl.load(slot_ptr + t)
    hk = tl.arange(0, HKV_PAD)[:, None]
    kmask = hk < NUM_KV_HEADS
    k_off = NUM_HEADS * HEAD_DIM + hk * HEAD_DIM + d[None, :]
    k1 = qkv_tile(row, part_row, bias_ptr, k_off, kmask, part_stride, PARTS, HAS_BIAS)
    k2 = qkv_tile(row, part_row, bias_ptr, k_off + HALF, kmask, part_stride, PARTS, HAS_BIAS)
    if QK_NORM:
        a, b = _head_rms(k1, k2, k_norm_ptr, eps, HALF, HEAD_DIM)
    else:
        a = k1.to(tl.float32)
        b = k2.to(tl.float32)
    v_off = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + hk * HEAD_DIM + d[None, :]
    v1 = qkv_tile(row, part_row, bias_ptr, v_off, kmask, part_stride, PARTS, HAS_BIAS)
    v2 = qkv_tile(row, part_row, bias_ptr, v_off + HALF, kmask, part_stride, PARTS, HAS_BIAS)
    wmask = kmask & ((hk * 0 + slot) >= 0)  # broadcast the scalar test to the tile
    c_off = tl.maximum(slot, 0) * (NUM_KV_HEADS * HEAD_DIM) + hk * HEAD_DIM + d[None, :]
    cdt = k_cache_ptr.dtype.element_ty
    r1, r2 = rope_halves(a, b, cos, sin)
    tl.store(k_cache_ptr + c_off, r1.to(cdt), mask=wmask)
    tl.store(k_cache_ptr + c_off + HALF, r2.to(cdt), mask=wmask)
    tl.store(v_cache_ptr + c_off, v1.to(cdt), mask=wmask)
    tl.store(v_cache_ptr + c_off + HALF, v2.to(cdt), mask=wmask)


def rope_and_cache_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
    qkv_parts: torch.Tensor | None = None,
    qkv_bias: torch.Tensor | None = None,
) -> None:
    """qkv: [T, (num_heads + 2*num_kv_heads) * head_dim], q rotated in place.
    qkv_parts: the QKV GEMM's split-K partials instead, fp32 or qkv's dtype [P, T, (num_heads + 2*num_kv_heads) *
    head_dim] contiguous, summed (+ qkv_bias) here; the rotated q is written to qkv's q columns.

    k_cache/v_cache: one layer, [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    positions, slot_mapping: [T] int64. cos/sin: [max_positions, head_dim // 2] fp32.
    """
    tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"rope_and_cache_write: qkv {tuple(qkv.shape)} is not [T, (Hq+2Hkv)*D] row-major")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_cache_write: the cache layer views must be contiguous")
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_and_cache_write: head_dim {head_dim} must be a power of two")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_and_cache_write: q_norm and k_norm come together")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv_parts is not None and (
        qkv_parts.dtype not in (torch.float32, qkv.dtype)
        or qkv_parts.shape[1:] != (tokens, width)
        or not qkv_parts.is_contiguous()
    ):
        raise ValueError(
            f"rope_and_cache_write: qkv_parts {tuple(qkv_parts.shape)} {qkv_parts.dtype} must be fp32 "
            f"(or qkv's dtype) [P, {tokens}, {width}]"
        )
    if qkv_bias is not None and qkv_parts is None:
        raise ValueError("rope_and_cache_write: qkv_bias goes with qkv_parts (a one-piece GEMM adds its own)")
    if tokens == 0:
        return
    _rope_cache_write_kernel[(tokens,)](
        qkv,
        qkv_parts if qkv_parts is not None else cos,
        qkv_bias if qkv_bias is not None else cos,
        positions,
        slot_mapping,
        cos,
        sin,
        k_cache,
        v_cache,
        q_norm if q_norm is not None else cos,
        k_norm if k_norm is not None else cos,
        qkv.stride(0),
        tokens * width,
        cos.shape[0],
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HQ_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        QK_NORM=q_norm is not None,
        PARTS=0 if qkv_parts is None else qkv_parts.shape[0],
        HAS_BIAS=qkv_bias is not None,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
