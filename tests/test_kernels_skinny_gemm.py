"""Few-row split-K GEMM vs torch, fp64 reference; odd M, N, K; poisoned outputs and partials."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.skinny_gemm import (  # noqa: E402
    SMEM_LIMIT,
    pipeline_stages,
    skinny_gemm,
    sum_partials,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
SHAPES = (
    [(8, 3072, 2048), (5, 2048, 8192), (16, 1000, 576), (128, 2048, 2048), (100, 1000, 576)]
    if GPU
    else [(3, 40, 72), (8, 64, 256), (1, 17, 33), (37, 24, 64)]  # 37 rows: a 64-row token tile
)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3, 4])
def test_skinny_gemm(shape, split_k):
    M, N, K = shape
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = (0.05 * torch.randn(N, K, device=DEVICE)).to(dtype)
    want = x.double() @ w.double().t()
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    bk = 128 if GPU else 32
    if split_k == 1:
        skinny_gemm(x, w, out, block_n=32, block_k=bk)
    else:
        part = torch.full((split_k * M * N,), float("nan"), device=DEVICE)
        skinny_gemm(x, w, part, split_k=split_k, block_n=32, block_k=bk)
        sum_partials(part, out, split_k)
    assert torch.isfinite(out).all()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


def test_skinny_gemm_refuses_many_rows():
    with pytest.raises(ValueError, match="at most 256 rows"):
        skinny_gemm(torch.zeros(257, 8), torch.zeros(8, 8), torch.zeros(257, 8))


@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_gemm_with_silu_gate_prologue(split_k):
    M, N, K = (8, 2048, 8192) if GPU else (5, 24, 96)
    dtype = torch.bfloat16 if GPU else torch.float32
    gate_up = torch.randn(M, 2 * K, device=DEVICE).to(dtype)
    w = (0.05 * torch.randn(N, K, device=DEVICE)).to(dtype)
    act = torch.nn.functional.silu(gate_up[:, :K]) * gate_up[:, K:]
    want = act.double() @ w.double().t()
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    bk = 128 if GPU else 32
    if split_k == 1:
        skinny_gemm(gate_up, w, out, block_n=32, block_k=bk, silu_gate=True)
    else:
        part = torch.full((split_k * M * N,), float("nan"), device=DEVICE)
        skinny_gemm(gate_up, w, part, split_k=split_k, block_n=32, block_k=bk, silu_gate=True)
        sum_partials(part, out, split_k)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("split_k", [1, 2])
def test_skinny_gemm_reads_transposed_weight_storage(split_k):
    """W stored [K, N] (cuBLAS's NN layout) and passed as its [N, K] transposed view."""
    M, N, K = (8, 3072, 2048) if GPU else (6, 64, 128)
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w_kn = (0.05 * torch.randn(K, N, device=DEVICE)).to(dtype)
    want = x.double() @ w_kn.double()
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    bk = 128 if GPU else 32
    if split_k == 1:
        skinny_gemm(x, w_kn.t(), out, block_n=64 if GPU else 32, block_k=bk)
    else:
        part = torch.full((split_k * M * N,), float("nan"), device=DEVICE)
        skinny_gemm(x, w_kn.t(), part, split_k=split_k, block_n=64 if GPU else 32, block_k=bk)
        sum_partials(part, out, split_k)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("in_major", [False, True])
def test_skinny_gemm_gated_writes_silu_gate_times_up(in_major):
    """gated: the fused [2N, K] gate+up weight; out = silu(x @ gate^T) * (x @ up^T), rounded as
    silu_and_mul rounds it; N not a multiple of the tile (masked tail)."""
    M, N, K = (128, 8192, 2048) if GPU else (37, 40, 64)
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = (0.05 * torch.randn(2 * N, K, device=DEVICE)).to(dtype)
    if in_major:  # stored [K, 2N], passed as the transposed view (the forward's layout)
        w = w.t().contiguous().t()
    gate_up = (x.double() @ w.double().t()).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :N].double()).to(dtype).double() * gate_up[:, N:].double()
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    skinny_gemm(x, w, out, block_n=64 if GPU else 32, block_k=64 if GPU else 32, num_warps=8 if GPU else 4,
                gated=True)  # fmt: skip
    assert torch.isfinite(out).all()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


def test_skinny_gemm_gated_refuses_a_split():
    with pytest.raises(ValueError, match="gated needs"):
        skinny_gemm(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(2 * 4 * 8), split_k=2, gated=True)


def test_pipeline_stages_fit_shared_memory():
    # bf16 down at 128 rows (64x128 weight tile, 128x128 token tile): 48 KB a stage, 4 fit.
    assert pipeline_stages(4, (64 * 128 + 128 * 128) * 2) == 4
    # The same shape in fp32 (96 KB a stage): what overflowed the H100 before (288 KB asked for).
    fp32 = (64 * 128 + 128 * 128) * 4
    assert pipeline_stages(4, fp32) == 2 and 2 * fp32 <= SMEM_LIMIT
    with pytest.raises(ValueError, match="one pipeline stage needs"):
        pipeline_stages(4, SMEM_LIMIT + 1)


@pytest.mark.skipif(not GPU, reason="fp32 weights at 128 rows overflow shared memory only on a GPU")
def test_skinny_gemm_fp32_at_128_rows_compiles_with_fewer_stages():
    """The bf16-tuned down shape (128-deep K tiles, 4 stages) with fp32 weights at 128 rows: 288 KB of
    pipeline before the stage guard; now it compiles and matches."""
    M, N, K = 128, 576, 1536
    x = torch.randn(M, K, device=DEVICE)
    w = 0.05 * torch.randn(N, K, device=DEVICE)
    part = torch.full((4 * M * N,), float("nan"), device=DEVICE)
    out = torch.empty(M, N, device=DEVICE)
    skinny_gemm(x, w, part, split_k=4, block_k=128, num_warps=8, num_stages=4)
    sum_partials(part, out, 4)
    want = x.double() @ w.double().t()
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.skipif(not GPU, reason="bf16 partials need bf16 tl.dot, which the CPU interpreter gets wrong")
def test_skinny_gemm_bf16_partials_summed_by_add_rmsnorm():
    """Split-K partials kept in bf16 (half the bytes) and summed in fp32 by the norm that reads them."""
    from blink_appliance.kernels.rmsnorm import add_rmsnorm

    M, N, K, split = 128, 2048, 8192, 4
    x = torch.randn(M, K, device=DEVICE).to(torch.bfloat16)
    w = (0.05 * torch.randn(N, K, device=DEVICE)).to(torch.bfloat16).t().contiguous().t()
    part = torch.full((split, M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    skinny_gemm(x, w, part, split_k=split, block_k=128, num_warps=8, pdl=True)
    residual = torch.randn(M, N, device=DEVICE)
    norm_w = torch.rand(N, device=DEVICE).to(torch.bfloat16)
    want_res = residual.double() + x.double() @ w.double().t()
    want = want_res / want_res.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * norm_w.double()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    add_rmsnorm(part, norm_w, out, 1e-5, residual=residual, x_parts=split)
    assert ((residual.double() - want_res).norm() / want_res.norm()).item() < 1e-2
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_gemm_accumulates_into_an_fp32_stream(split_k):
    """accumulate: out (fp32, the residual stream) += x @ w^T; split slices add with atomics; a norm
    then reads the stream alone (x None), without writing it."""
    from blink_appliance.kernels.rmsnorm import add_rmsnorm

    M, N, K = (128, 2048, 2048) if GPU else (37, 40, 128)
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = (0.05 * torch.randn(K, N, device=DEVICE)).to(dtype).t()  # in-major storage, as the forward keeps it
    stream = torch.randn(M, N, device=DEVICE)
    want = stream.double() + x.double() @ w.double().t()
    bk = 64 if GPU else 32
    skinny_gemm(
        x, w, stream, split_k=split_k, block_k=bk, num_warps=8 if GPU else 4, accumulate=True, pdl=GPU
    )
    assert ((stream.double() - want).norm() / want.norm()).item() < (1e-3 if GPU else 1e-6)
    norm_w = (1 + 0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    before = stream.clone()
    add_rmsnorm(None, norm_w, out, 1e-5, residual=stream, pdl=GPU)
    assert torch.equal(stream, before)
    normed = (before * torch.rsqrt(before.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double()
    want_out = normed * norm_w.double()
    assert ((out.double() - want_out).norm() / want_out.norm()).item() < (1e-2 if GPU else 1e-5)


def test_skinny_gemm_accumulate_refuses_a_low_precision_stream():
    with pytest.raises(ValueError, match="accumulate needs an fp32 out"):
        skinny_gemm(
            torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, 16, dtype=torch.bfloat16), accumulate=True
        )
    with pytest.raises(ValueError, match="accumulate needs an fp32 out"):
        skinny_gemm(torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(4, 8), accumulate=True)
