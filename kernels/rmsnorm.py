"""RMSNorm fused with the residual add, optionally over a gathered subset of rows.

One program per output row. With a residual, the row first becomes `residual + x` (rounded to the
storage dtype, as the reference model's add is) and that sum is written back into the residual stream;
the norm is taken in fp32, cast to the storage dtype, then scaled by the weight, exactly the order of
the reference RMSNorm. With `rows`, output row r reads input row rows[r] (the final norm runs only on
the rows that sample); a negative index yields a zero row.
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
    hidden,
    x_stride,
    residual_stride,
    out_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if HAS_ROWS:
        src = tl.load(rows_ptr + r)
    else:
        src = r.to(tl.int64)
    valid = src >= 0
    src = tl.maximum(src, 0)
    x = tl.load(x_ptr + src * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + src * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        if WRITE_RESIDUAL:
            tl.store(residual_ptr + src * residual_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed * w
    y = tl.where(valid, y, 0.0)
    tl.store(out_ptr + r * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    write_residual: bool = True,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[r] = rmsnorm(x[src] (+ residual[src])) * weight, src = rows[r] if rows is given else r.

    x, residual: [N, H]; out: [R, H] (R = len(rows), or N). With a residual and write_residual, the
    sum is stored into residual[src] (the residual stream advances in place).
    """
    hidden = x.shape[-1]
    n_out = rows.shape[0] if rows is not None else x.shape[0]
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
        hidden,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        WRITE_RESIDUAL=residual is not None and write_residual,
        HAS_ROWS=rows is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 4096 else 8,
    )
    return out
