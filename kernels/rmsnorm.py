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
itself: no gather kernel). With `rows2` too, the same launch also gathers rows2 into `out2` (the
final norm's prompt rows that are scored, beside the sample rows), skipping negative entries.
With `tp` (tensor parallelism over two GPUs, model/tensor_parallel.py) x is this rank's share of the
GEMM's product and the kernel adds the peer rank's share too, read over NVLink, once the peer has
flagged it ready: the all-reduce costs no kernel or collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class PeerShare:
    """The peer rank's share of a norm's input (tensor parallelism over two ranks)."""

    rank: int  # this rank, 0 or 1
    x: torch.Tensor  # the peer's tensor laid out as this rank's x (peer memory)
    flags: torch.Tensor  # int32 [points], this rank's: the peer writes them
    peer_flags: torch.Tensor  # the peer's flags (peer memory)
    epoch: torch.Tensor  # int32 [1]: the step's number, the same on both ranks
    point: int  # which flag of the step this norm exchanges


@triton.jit
def _exchange_flags(flags_ptr, peer_flags_ptr, epoch_ptr, point, r):
    """Tell the peer this rank's share for `point` is ready (its GEMM finished: griddepcontrol.wait
    returned, or the kernel before ended), then wait until the peer says the same of its share. A
    flag holds the step's epoch, so flags need no reset between steps."""
    epoch = tl.load(epoch_ptr)
    if r == 0:
        tl.atomic_xchg(peer_flags_ptr + point, epoch, sem="release", scope="sys")
    seen = tl.atomic_add(flags_ptr + point, 0, sem="acquire", scope="sys")
    while seen < epoch:
        seen = tl.atomic_add(flags_ptr + point, 0, sem="acquire", scope="sys")


@triton.jit
def _sum_parts(
    xf, x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS: tl.constexpr, REMOTE: tl.constexpr
):
    """xf plus the X_PARTS split-K partials of row x_src, in order. The peer's are read uncached:
    the same addresses held last layer's values."""
    for p in tl.static_range(X_PARTS):
        ptrs = x_ptr + p * x_part_stride + x_src * x_stride + cols
        if REMOTE:
            part = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cv")
        else:
            part = tl.load(ptrs, mask=mask, other=0.0)
        xf += part.to(tl.float32)
    return xf


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    rows_ptr,
    x_rows_ptr,
    rows2_ptr,
    out2_ptr,
    n_first,
    hidden,
    x_stride,
    residual_stride,
    out_stride,
    out2_stride,
    x_part_stride,
    eps,
    peer_x_ptr,
    flags_ptr,
    peer_flags_ptr,
    epoch_ptr,
    point,
    X_PARTS: tl.constexpr,  # 0: no x, the residual already holds the sum
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_IN: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_X_ROWS: tl.constexpr,
    HAS_ROWS2: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    TP_RANK: tl.constexpr = -1,  # >= 0: add the peer rank's share of x (two ranks)
):
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if TP_RANK >= 0:
        _exchange_flags(flags_ptr, peer_flags_ptr, epoch_ptr, point, r)
    if HAS_ROWS2:
        first = r < n_first
        src = tl.where(
            first,
            tl.load(rows_ptr + tl.minimum(r, n_first - 1)),
            tl.load(rows2_ptr + tl.maximum(r - n_first, 0)),
        )
    elif HAS_ROWS:
        src = tl.load(rows_ptr + r)
    else:
        src = r.to(tl.int64)
    valid = src >= 0
    if HAS_ROWS2:  # a second-list row that is unused reads and writes nothing (vector masks: the
        # interpreter takes no scalar ones)
        first_v = (cols * 0 + r) < n_first
        mask = mask & (((cols * 0 + src) >= 0) | first_v)
    src = tl.maximum(src, 0)
    out_dtype = out_ptr.dtype.element_ty
    x_src = tl.load(x_rows_ptr + r).to(tl.int64) if HAS_X_ROWS else src
    xf = tl.zeros([BLOCK], tl.float32)
    if TP_RANK < 0:
        xf = _sum_parts(xf, x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS, False)
    elif TP_RANK == 0:  # rank 0's share first on both ranks, so both streams get the same bits
        xf = _sum_parts(xf, x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS, False)
        xf = _sum_parts(xf, peer_x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS, True)
    else:
        xf = _sum_parts(xf, peer_x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS, True)
        xf = _sum_parts(xf, x_ptr, x_src, cols, mask, x_stride, x_part_stride, X_PARTS, False)
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
    if HAS_ROWS2:
        tl.store(out_ptr + r * out_stride + cols, y.to(out_dtype), mask=mask & first_v)
        tl.store(out2_ptr + (r - n_first) * out2_stride + cols, y.to(out_dtype), mask=mask & ~first_v)
    else:
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
    rows2: torch.Tensor | None = None,
    out2: torch.Tensor | None = None,
    peer: PeerShare | None = None,
) -> torch.Tensor:
    """out[r] = rmsnorm(x[src] (+ residual[src])) * weight, src = rows[r] if rows is given else r.

    x, residual: [N, H]; out: [R, H] (R = len(rows), or N). With a residual and write_residual, the
    sum is stored into residual[src] (the residual stream advances in place). residual_in=False
    starts the stream: residual[src] = x[src], nothing read from it. x_parts > 1: x is
    [x_parts, N, H] partials (contiguous; fp32, or the activations' dtype) summed in fp32 on load.
    x None: the residual already holds the sum (a GEMM accumulated into it); it is normed, not written.
    x_rows: row r reads x[x_rows[r]] (an embedding table gathered by token id) instead of x[src];
    not with rows or partials. rows2, out2 (with rows, without writing the residual): out2[i] is
    the same of input row rows2[i]; rows2[i] < 0 leaves out2[i] as it was. peer: x is this rank's
    share and the peer's (same layout) is added, rank 0's first, after the ranks' flags meet.
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
    if (rows2 is None) != (out2 is None) or (rows2 is not None and (rows is None or write_residual)):
        raise ValueError(
            "add_rmsnorm: rows2 and out2 come together, with rows and without writing the residual"
        )
    hidden = x.shape[-1]
    gather = rows if rows is not None else x_rows
    n_out = gather.shape[0] if gather is not None else x.shape[-2]
    if out.shape[0] < n_out or out.shape[-1] != hidden:
        raise ValueError(f"add_rmsnorm: out {tuple(out.shape)} cannot hold {n_out} rows of {hidden}")
    n_second = rows2.shape[0] if rows2 is not None else 0
    if n_second and (out2.shape[0] < n_second or out2.shape[-1] != hidden):
        raise ValueError(f"add_rmsnorm: out2 {tuple(out2.shape)} cannot hold {n_second} rows of {hidden}")
    if peer is not None and (x_parts == 0 or peer.x.shape != x.shape or peer.x.stride() != x.stride()):
        raise ValueError("add_rmsnorm: the peer's share must be laid out as x")
    if n_out + n_second == 0:
        return out
    _add_rmsnorm_kernel[(n_out + n_second,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        rows if rows is not None else x,
        x_rows if x_rows is not None else x,
        rows2 if n_second else x,
        out2 if n_second else out,
        n_out,
        hidden,
        x.stride(-2),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        out2.stride(0) if n_second else 0,
        x.stride(0) if x_parts > 1 else 0,
        eps,
        peer.x if peer else x,
        peer.flags if peer else x,
        peer.peer_flags if peer else x,
        peer.epoch if peer else x,
        peer.point if peer else 0,
        X_PARTS=x_parts,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_IN=residual_in,
        WRITE_RESIDUAL=residual is not None and write_residual,
        HAS_ROWS=rows is not None,
        HAS_X_ROWS=x_rows is not None,
        HAS_ROWS2=n_second > 0,
        BLOCK=triton.next_power_of_2(hidden),
        USE_PDL=pdl,
        TP_RANK=peer.rank if peer else -1,
        num_warps=4 if hidden <= 4096 else 8,
        launch_pdl=pdl,
    )
    return out
