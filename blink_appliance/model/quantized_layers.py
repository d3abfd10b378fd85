"""The quantized CPU build's decoder pieces: fused int4 projections and fewer small ops per layer.

`loaders/quantize.py` swaps these in for llama.py's Attention, MLP and RMSNorm when a GGUF's matrices
stay quantized. They compute the same function with fewer eager ops, since at batch 1 on the CPU a
token's time is as much per-op overhead as matmul:

- q/k/v are one int4 matmul and gate/up another (the weights concatenated along the output dim at
  load), so the activation is cast to bfloat16 once and the kernel launched once;
- RoPE rotates q and k together, RMSNorm is `F.rms_norm`;
- a decode step of one sequence attends without a mask or the padded gather/scatter of
  llama.paged_attention (its one query is the newest position, so every key in its context is visible).

The default fp32 reference path (llama.py's modules) is untouched: it stays the spec the GPU loop
tests compare against. These differ from it only by float rounding order, inside the tolerance that
tests/test_quantized_linear.py already allows the bfloat16 int4 path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.llama import AttentionPlan, RMSNorm, apply_rope, paged_attention
from blink_appliance.model.quantized_linear import QuantizedLinear, code_kind, concat_rows


class FusedQuantizedLinear(nn.Module):
    """One int4 matmul for several QuantizedLinears on the same input; returns their outputs in order.

    The originals stay registered (by their checkpoint names, so their biases load as before) but give
    their packed weights up to this module.
    """

    def __init__(self, linears: list[QuantizedLinear], codes: list) -> None:
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.fused = QuantizedLinear(concat_rows(codes))
        self.linears = linears  # a plain list: not registered twice, only read for their biases
        for lin in linears:
            lin.parts = []

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = list(self.fused(x).split(self.sizes, dim=-1))
        return [y if lin.bias is None else y + lin.bias for y, lin in zip(outs, self.linears, strict=True)]


def can_fuse(codes: list) -> bool:
    """Same packing for every part: a Q4_1 matrix next to a Q8_0 one would double its matmuls."""
    return len({code_kind(w) for w in codes}) == 1


class FastRMSNorm(RMSNorm):
    """RMSNorm as one fused op (llama.RMSNorm spells it out in five, for the reference's exact rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _key_span(plan: AttentionPlan) -> tuple[int, int] | None:
    """(first slot, length) when the decode sequence's keys fill consecutive cache slots, else None.

    Computed once per step and kept on the plan, which every layer shares: consecutive slots (the
    usual case, blocks handed out in order) are read as a view instead of gathered.
    """
    span = plan.__dict__.get("_key_span", False)
    if span is False:
        slots = plan.groups[0].key_slots[0]
        first, n = int(slots[0]), int(slots.shape[0])
        span = (first, n) if int(slots[-1]) - first == n - 1 and bool((slots.diff() == 1).all()) else None
        plan.__dict__["_key_span"] = span
    return span


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """M with x @ M == apply_rope(x) at one position (cos/sin [head_dim]): one matmul instead of seven ops."""
    d = cos.shape[0]
    half = d // 2
    m = torch.diag(cos)
    j = torch.arange(half)
    m[j + half, j] = -sin[:half]  # out[j] = x[j] cos[j] - x[j + half] sin[j]
    m[j, j + half] = sin[half:]  # out[j + half] = x[j + half] cos[j + half] + x[j] sin[j + half]
    return m


def _rope_matrix(plan: AttentionPlan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_matrix of a one-token step, built once and kept on the plan that every layer shares."""
    m = plan.__dict__.get("_rope_matrix")
    if m is None:
        m = plan.__dict__["_rope_matrix"] = rope_matrix(cos[0], sin[0])
    return m


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """paged_attention for a step of one decode token: q [1, n_heads, head_dim] -> [1, n_heads, head_dim]."""
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    span = _key_span(plan)
    if span is None:
        slots = plan.groups[0].key_slots[0]  # one sequence: no padding keys, all visible to its query
        keys, values = flat_k.index_select(0, slots), flat_v.index_select(0, slots)
    else:
        keys, values = flat_k.narrow(0, *span), flat_v.narrow(0, *span)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        scale=scale,
        enable_gqa=True,
    )
    return attn[0].transpose(0, 1)


def is_single_decode(plan: AttentionPlan, n_tokens: int) -> bool:
    return n_tokens == 1 and len(plan.groups) == 1 and plan.groups[0].rows.shape == (1, 1)


class QuantizedAttention(nn.Module):
    """llama.Attention over a fused q/k/v projection (same submodule names, so the same checkpoint keys)."""

    def __init__(self, config: ModelConfig, old: nn.Module, qkv: FusedQuantizedLinear) -> None:
        super().__init__()
        self.config = config
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = old.q_proj, old.k_proj, old.v_proj, old.o_proj
        if config.qk_norm:
            self.q_norm, self.k_norm = old.q_norm, old.k_norm
        self.qkv = qkv
        # Without a per-head norm or biases, q and k are adjacent columns of the fused output.
        self.rotate_together = not config.qk_norm and all(lin.bias is None for lin in qkv.linears)

    def forward(self, x, cos, sin, plan: AttentionPlan, k_cache, v_cache) -> torch.Tensor:
        c = self.config
        T = x.shape[0]
        if not self.rotate_together:
            q, k, v = self.qkv(x)
            q = q.reshape(T, c.num_heads, c.head_dim)
            k = k.reshape(T, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # one RoPE over q's and k's heads
            y = self.qkv.fused(x)
            qk = y[:, : c.q_size + c.kv_size].view(T, -1, c.head_dim)
            qk = qk[0] @ _rope_matrix(plan, cos, sin) if T == 1 else apply_rope(qk, cos, sin)
            qk = qk.view(T, -1, c.head_dim)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = y[:, c.q_size + c.kv_size :]
        v = v.reshape(T, c.num_kv_heads, c.head_dim)

        if plan.write_rows is not None:
            k, v = k.index_select(0, plan.write_rows), v.index_select(0, plan.write_rows)
        k_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, plan.write_slots, k)
        v_cache.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, plan.write_slots, v)

        scale = c.head_dim**-0.5
        if is_single_decode(plan, T):
            attn = decode_attention(q, k_cache, v_cache, plan, scale)
        else:
            attn = paged_attention(q, k_cache, v_cache, plan, scale)
        return self.o_proj(attn.reshape(T, c.q_size))


class QuantizedMLP(nn.Module):
    """llama.MLP with gate and up as one int4 matmul."""

    def __init__(self, old: nn.Module, gate_up: FusedQuantizedLinear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = old.gate_proj, old.up_proj, old.down_proj
        self.gate_up = gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.fused(x).chunk(2, dim=-1)  # llama.MLP's gate/up have no bias
        return self.down_proj(F.silu(gate) * up)
