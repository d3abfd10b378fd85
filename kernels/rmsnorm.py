"""RMSNorm fused with the residual add, optionally over a gathered subset of rows.

One program per output row. With a residual, the row first becomes `residual + x` (rounded to the
residual's dtype) and that sum is written back into the residual stream; with `residual_in=False` the
stream is only started (residual = x, for the first layer). The norm is taken in fp32, cast to the
output dtype, then scaled by the weight: the order of the reference RMSNorm. The residual may be fp32
under bf16 activations (a more accurate stream at the cost of a few KB per token of traffic).
With `x_parts > 1`, x is the split-K partials of the GEMM before (`[x_parts, rows, H]`) and the
kernel sums them first: the split-K reduction costs no kernel of its own. With x None the residual
already holds the sum (a GEMM added into it) and is only normed. With `rows`, output row r reads
input row rows[r] (the final norm runs only on the rows that sample); a negative index yields a zero
row. With `x_rows`, row r reads x row x_rows[r] (the first layer's norm gathers the token embeddings
itself: no gather kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    rows_ptr,
    x_rows_ptr,
    hidden,
    x_stride,
    residual_stride,
    out_stride,
    x_part_stride,
    eps,
    X_PARTS: tl.constexpr,  # 0: no x, the residual already holds the sum
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_IN: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_X_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_ROWS:
        src = tl.load(rows_ptr + r)
    else:
        src = r.to(tl.int64)
    valid = src >= 0
    src = tl.maximum(src, 0)
    out_dtype = out_ptr.dtype.element_ty
    x_src = tl.load(x_rows_ptr + r).to(tl.int64) if HAS_X_ROWS else src
    xf = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(X_PARTS):
        part = tl.load(x_ptr + p * x_part_stride + x_src * x_stride + cols, mask=mask, other=0.0)
        xf += part.to(tl.float32)
    if HAS_RESIDUAL:
        res_dtype = residual_ptr.dtype.element_ty
        if RESIDUAL_IN:
            res = tl.load(residual_ptr + src * residual_stride + cols, mask=mask, other=0.0)
            xf = xf + res.to(tl.float32)
        summed = xf.to(res_dtype)
        xf = summed.to(tl.float32)
        if WRITE_RESIDUAL:
            tl.store(residual_ptr + src * residual_stride + cols, summed, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(out_dtype).to(tl.float32)
    y = normed * w
    y = tl.where(valid, y, 0.0)
    tl.store(out_ptr + r * out_stride + cols, y.to(out_dtype), mask=mask)


def add_rmsnorm(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    write_residual: bool = True,
    rows: torch.Tensor | None = None,
    residual_in: bool = True,
    x_parts: int = 1,
    x_rows: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """out[r] = rmsnorm(x[src] (+ residual[src])) * weight, src = rows[r] if rows is given else r.

    x, residual: [N, H]; out: [R, H] (R = len(rows), or N). With a residual and write_residual, the
    sum is stored into residual[src] (the residual stream advances in place). residual_in=False
    starts the stream: residual[src] = x[src], nothing read from it. x_parts > 1: x is
    [x_parts, N, H] partials (contiguous; fp32, or the activations' dtype) summed in fp32 on load.
    x None: the residual already holds the sum (a GEMM accumulated into it); it is normed, not written.
    x_rows: row r reads x[x_rows[r]] (an embedding table gathered by token id) instead of x[src];
    not with rows or partials.
    """
    if x is None:
        if residual is None or not residual_in:
            raise ValueError("add_rmsnorm: without x it norms the residual, which must be given and read")
        x, x_parts, write_residual = residual, 0, False
    if x_parts > 1 and (x.dim() != 3 or x.shape[0] != x_parts or not x.is_contiguous()):
        raise ValueError("add_rmsnorm: x_parts > 1 needs contiguous partials [x_parts, N, H]")
    if x_rows is not None and (rows is not None or x_parts != 1):
        raise ValueError("add_rmsnorm: x_rows gathers plain x rows, without rows or partials")
    if not residual_in and (residual is None or not write_residual):
        raise ValueError("add_rmsnorm: residual_in=False needs a residual to write")
    hidden = x.shape[-1]
    gather = rows if rows is not None else x_rows
    n_out = gather.shape[0] if gather is not None else x.shape[-2]
    if out.shape[0] < n_out or out.shape[-1] != hidden:
        raise ValueError(f"add_rmsnorm: out {tuple(out.shape)} cannot hold {n_out} rows of {hidden}")
    if n_out == 0:
        return out
    _add_rmsnorm_kernel[(n_out,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        rows if rows is not None else x,
        x_rows if x_rows is not None else x,
        hidden,
        x.stride(-2),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        x.stride(0) if x_parts > 1 else 0,
        eps,
        X_PARTS=x_parts,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_IN=residual_in,
        WRITE_RESIDUAL=residual is not None and write_residual,
        HAS_ROWS=rows is not None,
        HAS_X_ROWS=x_rows is not None,
        BLOCK=triton.next_power_of_2(hidden),
        USE_PDL=pdl,
        num_warps=4 if hidden <= 4096 else 8,
        launch_pdl=pdl,
    )
    return out
