"""Few-row split-K GEMM vs torch, fp64 reference; odd M, N, K; poisoned outputs and partials."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.skinny_gemm import skinny_gemm, sum_partials  # noqa: E402

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
