"""GGUF weights kept quantized on the CPU: Linear and Embedding over torch's int4 weight-only kernel.

A GGUF Q4_0/Q4_1/Q8_0 tensor is a matrix of small integer codes with one scale (and for Q4_1 one
offset) per 32 consecutive inputs of a row: w = code * scale + offset. `GroupCodes` holds exactly
that, so nothing is lost when loading. The matmul runs through torch's CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`, the one torchao's CPU int4 weight-only path uses), which computes
w = (q - 8) * scale + zero per group of 32 with q in 0..15:

- Q4_0 (codes -8..7) and Q4_1 (codes 0..15) map onto it exactly;
- Q8_0 (codes -127..127) is split into its high and low nibble, two int4 matmuls whose sum is the
  exact product (16 * hi + lo == code), so the 8-bit weights are never rounded to 4 bits.

That kernel is vectorized for bfloat16 activations only (fp32 and fp16 take a scalar path about 20x
slower on an AVX-512 host), so activations, scales and offsets are rounded to bfloat16 around each
matmul and the output comes back in the caller's dtype. This is the numerical difference from the
reference model (which dequantizes to fp32); tests/test_quantized_linear.py bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # GGUF's Q4_0/Q4_1/Q8_0 block length, also a group size torch's int4 kernel supports
_ACT_DTYPE = torch.bfloat16
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu wants N % 16 == 0
# The overload itself: calling it skips the op packet's Python dispatch, a few us of each matmul's ~10.
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


@dataclass
class GroupCodes:
    """A [N, K] weight as codes [N, K] (int8 or uint8) with scale/offset [N, K // 32] (fp32).

    w[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32], exactly what GGUF dequantizes to.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        w = self.codes.to(torch.float32).view(n, k // GROUP, GROUP)
        return (w * self.scale[..., None] + self.offset[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows index (any shape) -> [*index.shape, K], fp32: an embedding lookup."""
        n, k = self.shape
        flat = index.reshape(-1)
        w = self.codes.index_select(0, flat).to(torch.float32).view(-1, k // GROUP, GROUP)
        w = w * self.scale.index_select(0, flat)[..., None] + self.offset.index_select(0, flat)[..., None]
        return w.view(*index.shape, k)

    def permute_rows(self, fn) -> GroupCodes:
        """The same weight with its rows reordered by fn (applied to codes, scales and offsets alike)."""
        return GroupCodes(
            fn(self.codes).contiguous(), fn(self.scale).contiguous(), fn(self.offset).contiguous()
        )


def _pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 and per-group scale/zero [N, G] -> torch's packed weight and [G, N, 2] table.

    The kernel packs rows in sixteens: N is padded with zero rows (scale 0, zero 0: outputs 0),
    which QuantizedLinear slices off.
    """
    pad = -q.shape[0] % _ROW_MULTIPLE
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    table = torch.stack((scale.t(), zero.t()), dim=-1).to(_ACT_DTYPE).contiguous()
    return packed, table


def code_kind(w: GroupCodes) -> str:
    """ "q4_1" (codes 0..15), "q4_0" (-8..7) or "q8" (-128..127): which int4 packing int4_parts uses."""
    lo_code, hi_code = int(w.codes.min()), int(w.codes.max())
    if lo_code >= 0 and hi_code <= 15:
        return "q4_1"
    if lo_code >= -8 and hi_code <= 7:
        return "q4_0"
    if lo_code >= -128 and hi_code <= 127:
        return "q8"
    raise ValueError(f"quantized codes in {lo_code}..{hi_code}: not 4- or 8-bit")


def concat_rows(ws: list[GroupCodes]) -> GroupCodes:
    """The weights stacked along the output dim: one matrix whose product holds each one's, in order."""
    codes = [w.codes for w in ws]
    if len({c.dtype for c in codes}) > 1:  # uint8 Q4_1 next to int8 codes: a type holding both
        codes = [c.to(torch.int16) for c in codes]
    return GroupCodes(torch.cat(codes), torch.cat([w.scale for w in ws]), torch.cat([w.offset for w in ws]))


def int4_parts(w: GroupCodes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The int4 matmuls whose sum is x @ w.T: one for 4-bit codes, two (high/low nibble) for 8-bit ones."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantized weight of {k} inputs: not a multiple of the group size {GROUP}")
    kind = code_kind(w)
    codes = w.codes.to(torch.int32)
    if kind == "q4_1":  # (q - 8) * s + (offset + 8 s) == q * s + offset
        return [_pack(codes, w.scale, w.offset + 8 * w.scale)]
    if kind == "q4_0":
        return [_pack(codes + 8, w.scale, w.offset)]
    if kind == "q8":  # Q8_0: code = 16 * hi + lo, hi in -8..7, lo in 0..15
        hi, lo = codes >> 4, codes & 15
        return [
            _pack(hi + 8, 16 * w.scale, w.offset),
            _pack(lo, w.scale, 8 * w.scale),
        ]
    raise AssertionError(kind)


class QuantizedLinear(nn.Module):
    """y = x @ w.T (+ bias) with w kept as int4 groups (see the module docstring)."""

    def __init__(self, w: GroupCodes, bias: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        # Plain attributes, not buffers: a model-wide .to(dtype) must not cast the packed bytes or
        # the bfloat16 scale tables the kernel requires.
        self.parts = int4_parts(w)
        # Loaded by name like nn.Linear's (q/k/v biases of Qwen2), and cast with the model.
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parts:
            raise RuntimeError(f"{self.extra_repr()}: its weights moved into a fused projection")
        x2 = (x if x.dim() == 2 else x.reshape(-1, self.in_features)).to(_ACT_DTYPE)
        if (
            len(self.parts) == 1
        ):  # the common case, with the fewest ops: at batch 1 each costs a matmul's tenth
            y = _INT4_MM(x2, self.parts[0][0], GROUP, self.parts[0][1])
        else:
            y = sum(_INT4_MM(x2, packed, GROUP, table).to(torch.float32) for packed, table in self.parts)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 parts={len(self.parts)}"
        )


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as GGUF codes; a lookup dequantizes only the rows it reads (exactly)."""

    def __init__(self, w: GroupCodes, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = w  # a plain attribute for the same reason as QuantizedLinear.parts
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).to(self.dtype)
