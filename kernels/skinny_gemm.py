"""GEMM for few rows (decode buckets): out[M, N] = x[M, K] @ W[N, K]^T with M <= 16, split over K.

Decode-sized GEMMs are weight-streaming problems: every byte of W is read once and the arithmetic is
free. What matters is how many loads are in flight, which for narrow N (the QKV and O projections of
a small model) means cutting K into SPLIT_K slices so that enough programs run. The slices land in
fp32 partials `[SPLIT_K, M, N]`, summed by `sum_partials` (or by a consumer kernel that reads them);
with SPLIT_K = 1 the program writes `out` directly in its dtype.

With `silu_gate=True` the input is the fused gate+up activation `[M, 2K]` and the GEMM multiplies
silu(gate) * up, computed on the fly per K tile (rounded as `silu_and_mul` rounds it): the MLP's down
projection then needs no separate activation kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    out_stride,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_GATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_in = k < k_hi
        x_mask = (rows[:, None] < M) & k_in[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=x_mask, other=0.0)
        if SILU_GATE:
            up = tl.load(x_ptr + rows[:, None] * x_stride + K + k[None, :], mask=x_mask, other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(up.dtype)
        w = tl.load(w_rows + k[None, :], mask=(cols[:, None] < N) & k_in[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(
            out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
        )
    else:
        part = out_ptr + (split * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, M, N, out_stride, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + m * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    split_k: int = 1,
    block_n: int = 64,
    block_k: int = 128,
    num_stages: int = 4,
    num_warps: int = 4,
    silu_gate: bool = False,
) -> torch.Tensor:
    """x: [M, K] (M <= 16), or [M, 2K] gate|up with silu_gate; w: [N, K] row-major; out: [M, N] when
    split_k == 1, else fp32 partials holding at least split_k * M * N elements (laid out [split_k, M, N])."""
    M, K = x.shape
    if silu_gate:
        K //= 2
    N = w.shape[0]
    if M > 16:
        raise ValueError(f"skinny_gemm: at most 16 rows, got {M}")
    if w.shape[1] != K or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} must be row-major [M,K], [N,K]"
        )
    if split_k > 1 and (out.dtype != torch.float32 or out.numel() < split_k * M * N):
        raise ValueError("skinny_gemm: split_k > 1 needs fp32 partials of split_k * M * N elements")
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    _skinny_gemm_kernel[(triton.cdiv(N, block_n), split_k)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0) if split_k == 1 else N, k_per_split,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, SILU_GATE=silu_gate, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_stages=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out


def sum_partials(partials: torch.Tensor, out: torch.Tensor, split_k: int) -> torch.Tensor:
    """out[M, N] = sum over the split_k slices of partials [split_k, M, N] (fp32), cast to out's dtype."""
    M, N = out.shape
    block = min(1024, triton.next_power_of_2(N))
    _sum_partials_kernel[(M, triton.cdiv(N, block))](
        partials, out, M, N, out.stride(0), SPLIT_K=split_k, BLOCK=block
    )
    return out
