"""GEMM for few rows (decode buckets): out[M, N] = x[M, K] @ W[N, K]^T, M up to 256, split over K.

Decode-sized GEMMs are weight-streaming problems: every byte of W is read once and the arithmetic is
free. The kernel is written "swap-AB": a program's weight tile [BLOCK_N, BLOCK_K] is the MMA's A
operand (M side, so Hopper's warpgroup MMA with M = 64 applies) and the few tokens are its N side
(x^T tile [BLOCK_K, BLOCK_T], all M rows in one tile, BLOCK_T >= 16); acc[BLOCK_N, BLOCK_T] is stored
transposed. Every weight byte is read by exactly one program. With the tokens on the A side
instead (an earlier version) the MMA ran at M = 16 and the step was slower than cuBLAS.
Narrow N (the O projection of a small model) leaves too few programs, so K can be cut into SPLIT_K
slices: they land in partials `[SPLIT_K, M, N]` (fp32, or x's dtype for half the bytes), summed in
fp32 by `sum_partials` or by the consumer (add+RMSNorm, RoPE); with SPLIT_K = 1 the program writes
`out` in its dtype. With `accumulate` the slices instead add into an fp32 `out` with atomics (the
residual stream: O and down then need no partials and the norm after them no sum).

With `silu_gate=True` the input is the fused gate+up activation `[M, 2K]` and the GEMM multiplies
silu(gate) * up, computed on the fly per K tile (rounded as `silu_and_mul` rounds it): the MLP's down
projection then needs no separate activation kernel. That recomputes the activation per weight tile,
free at a few rows. At many rows `gated=True` moves the SiLU to the other side: the gate+up GEMM's
program takes a gate tile and the matching up tile of the fused weight and writes silu(gate) * up.

Pipeline stages are lowered until they fit shared memory (`pipeline_stages`): the launch shapes are
tuned for 2-byte weights, and fp32 weights at 128 rows would not compile otherwise.

Measured on the H100 (bench/gemm_chain.py, 16 launches in one graph, llama-3.2-1b, 8 tokens):
O 91 us vs cuBLAS 114, down 225 vs 271, gate+up 403 vs 422, QKV 116 vs 129.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 256  # every row sits in one token tile (BLOCK_T), so the weights are read once


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride_n,
    w_stride_k,
    out_stride,
    k_per_split,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_GATE: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATED: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride_n
    up_rows = w_rows + N * w_stride_n  # GATED: the up half of the fused gate+up weight
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        x_off = x_ptr + t[None, :] * x_stride + k[:, None]
        # Weights load evict-first: a step streams gigabytes of them through L2 once, and marked
        # first to go they leave the loop's small kernels their code and state there.
        if EVEN:  # N and the K slices are whole tiles: unmasked weight loads
            x_mask = t[None, :] < M
            w = tl.load(w_rows + k[None, :] * w_stride_k, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(up_rows + k[None, :] * w_stride_k, eviction_policy="evict_first")
        else:
            k_in = k < k_hi
            x_mask = (t[None, :] < M) & k_in[:, None]
            w_mask = (n[:, None] < N) & k_in[None, :]
            w = tl.load(
                w_rows + k[None, :] * w_stride_k, mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
            if GATED:
                w_up = tl.load(
                    up_rows + k[None, :] * w_stride_k, mask=w_mask, other=0.0, eviction_policy="evict_first"
                )
        x = tl.load(x_off, mask=x_mask, other=0.0)
        if SILU_GATE:
            up = tl.load(x_off + K, mask=x_mask, other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(up.dtype)
        acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(w_up, x, acc_up, input_precision=DOT_PRECISION)
    mask = (t[None, :] < M) & (n[:, None] < N)
    if GATED:  # out = silu(gate) * up, rounded where silu_and_mul rounds (gate, up, silu(gate))
        out_ty = out_ptr.dtype.element_ty
        g = acc.to(out_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    if ACCUMULATE:  # out (fp32) += acc: one owner per element unsplit, else the slices add atomically
        dst = out_ptr + t[None, :] * out_stride + n[:, None]
        if SPLIT_K == 1:
            tl.store(dst, tl.load(dst, mask=mask, other=0.0) + acc, mask=mask)
        else:
            tl.atomic_add(dst, acc, mask=mask, sem="relaxed")
    elif SPLIT_K == 1:
        tl.store(out_ptr + t[None, :] * out_stride + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = out_ptr + (split * M + t[None, :]).to(tl.int64) * N + n[:, None]
        tl.store(part, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, M, N, out_stride, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Shared memory one block may hold on sm_90 (227 KB): the pipeline's stages must fit in it.
SMEM_LIMIT = 232448


def pipeline_stages(num_stages: int, per_stage_bytes: int) -> int:
    """The deepest pipeline up to num_stages whose buffers fit shared memory. Launch shapes are tuned
    for 2-byte weights; 4-byte weights at many rows need fewer stages (Triton refuses to compile an
    over-full pipeline: fp32 down at 128 rows asked for 288 KB)."""
    fit = SMEM_LIMIT // per_stage_bytes
    if fit < 1:
        raise ValueError(f"skinny_gemm: one pipeline stage needs {per_stage_bytes} B of shared memory")
    return max(1, min(num_stages, fit))


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
    gated: bool = False,
    accumulate: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """x: [M, K] (M <= 256, padded to a power of two >= 16 in the MMA), or [M, 2K] gate|up with
    silu_gate; w: [N, K] (any strides: row-major, or the transposed view of a [K, N] matrix); out:
    [M, N] when split_k == 1, else partials holding at least split_k * M * N elements (laid out
    [split_k, M, N]; fp32, or x's dtype for half the bytes at one more rounding per slice).
    gated: w is the fused [2N, K] gate+up weight and out[M, N] = silu(x @ gate^T) * (x @ up^T), the
    MLP activation written by the GEMM itself (split_k 1).
    accumulate: out is an fp32 [M, N] sum that the product is added to (out += x @ w^T); with split_k > 1
    each slice adds its part with fp32 atomics, so there are no partials, and the order of the adds (the
    last bits of the sum) varies from run to run.
    pdl: launch as a programmatic dependent (sm_90+; waits for the kernel before prior to reading x)."""
    M, K = x.shape
    if silu_gate:
        K //= 2
    N = w.shape[0] // 2 if gated else w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_gemm: at most {MAX_ROWS} rows, got {M}")
    if w.shape[1] != K or x.stride(1) != 1:
        raise ValueError(
            f"skinny_gemm: x {tuple(x.shape)} must be row-major [M,K] and w {tuple(w.shape)} [N,K]"
        )
    if gated and (split_k != 1 or silu_gate or w.shape[0] % 2):
        raise ValueError("skinny_gemm: gated needs an even [2N, K] gate+up weight, split_k 1, no silu_gate")
    if accumulate and (out.dtype != torch.float32 or out.shape[0] < M or out.shape[-1] != N or gated):
        raise ValueError("skinny_gemm: accumulate needs an fp32 out [M, N] and no gated")
    partials = split_k > 1 and not accumulate
    if partials and (out.dtype not in (torch.float32, x.dtype) or out.numel() < split_k * M * N):
        raise ValueError(
            "skinny_gemm: split_k > 1 needs fp32 (or x's dtype) partials of split_k * M * N elements"
        )
    if not partials and out.stride(-1) != 1:
        raise ValueError("skinny_gemm: out must be row-major")
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    even = N % block_n == 0 and K % k_per_split == 0
    block_t = max(16, triton.next_power_of_2(M))
    w_tiles = 2 if gated else 1
    stage_bytes = (w_tiles * block_n * block_k + block_k * block_t) * x.element_size()
    _skinny_gemm_kernel[(triton.cdiv(N, block_n), split_k)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), w.stride(1), N if partials else out.stride(0),
        k_per_split, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, SILU_GATE=silu_gate, EVEN=even,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GATED=gated, ACCUMULATE=accumulate, USE_PDL=pdl,
        num_stages=pipeline_stages(num_stages, stage_bytes), num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


def sum_partials(partials: torch.Tensor, out: torch.Tensor, split_k: int) -> torch.Tensor:
    """out[M, N] = sum in fp32 over the split_k slices of partials [split_k, M, N] (fp32 or a 2-byte
    dtype), cast to out's dtype."""
    M, N = out.shape
    block = min(1024, triton.next_power_of_2(N))
    _sum_partials_kernel[(M, triton.cdiv(N, block))](
        partials, out, M, N, out.stride(0), SPLIT_K=split_k, BLOCK=block
    )
    return out
