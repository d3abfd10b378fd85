"""SiLU-and-mul over the fused gate+up projection: out = silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    inter,
    gate_up_stride,
    out_stride,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = gate_up_ptr + t.to(tl.int64) * gate_up_stride
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the GEMM that writes gate_up
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + inter + cols, mask=mask, other=0.0)
    # The reference computes silu(gate) in the storage dtype, then multiplies (rounded again).
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = act * up.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up: [T, 2*I] (gate in the first half, up in the second); out: [T, I].
    pdl: launch as a programmatic dependent (sm_90+)."""
    tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    if two_inter % 2 or out.shape[0] < tokens or out.shape[1] != inter:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} does not fit out {tuple(out.shape)}")
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        inter,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
