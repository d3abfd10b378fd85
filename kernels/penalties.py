"""Triton kernel of the GPU loop's penalties (engine/loop/penalties.py): each penalized sample row's
logits changed in place, as engine/reference/penalties.py changes them, before the sampler reads
them: logit_bias, then repetition over the prompt's and generated tokens, then frequency and
presence over the generated ones.

One program per row (persistent). A token that occurs several times must be penalized once, so each
phase counts occurrences into the row's `counts` [V] with atomic adds, and after a barrier takes them
back with atomic exchanges to 0: the one lane that gets a nonzero count applies the change (and
knows how many there were), and the counts are all 0 again for the next phase and the next step.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

TOKEN_TILE = 256


@triton.jit
def _count(tokens_ptr, start, end, counts_ptr, TILE: tl.constexpr):
    for i0 in range(start, end, TILE):
        i = i0 + tl.arange(0, TILE)
        t = tl.load(tokens_ptr + i, mask=i < end, other=0)
        tl.atomic_add(counts_ptr + t, 1, mask=i < end)


@triton.jit
def _take_counts(tokens_ptr, start, end, counts_ptr, i0, TILE: tl.constexpr):
    """The tile's tokens and, for the first lane of each distinct token since _count, its count (0
    for the others); the counts are 0 again after it."""
    i = i0 + tl.arange(0, TILE)
    t = tl.load(tokens_ptr + i, mask=i < end, other=0)
    n = tl.atomic_xchg(counts_ptr + t, 0, mask=i < end)
    return t, tl.where(i < end, n, 0)


@triton.jit
def _penalties_kernel(
    logits_ptr, stride, n_rows_ptr, sample_slot_ptr, penalized_ptr, presence_ptr, frequency_ptr, repetition_ptr,
    n_bias_ptr, bias_ids_ptr, bias_values_ptr, token_ids_ptr, num_tokens_ptr, prompt_len_ptr, counts_ptr,
    V, MAX_MODEL_LEN: tl.constexpr, MAX_BIAS: tl.constexpr, TILE: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    for r in range(tl.program_id(0), tl.load(n_rows_ptr), tl.num_programs(0)):
        slot = tl.load(sample_slot_ptr + r)
        if slot >= 0:
            if tl.load(penalized_ptr + slot) != 0:
                x_ptr = logits_ptr + tl.cast(r, tl.int64) * stride
                counts = counts_ptr + tl.cast(r, tl.int64) * V
                tokens = token_ids_ptr + tl.cast(slot, tl.int64) * MAX_MODEL_LEN
                n_tokens, n_prompt = tl.load(num_tokens_ptr + slot), tl.load(prompt_len_ptr + slot)
                # 1. logit_bias (ids checked at admission).
                n_bias = tl.load(n_bias_ptr + slot)
                for j0 in range(0, n_bias, TILE):
                    j = j0 + tl.arange(0, TILE)
                    ids = tl.load(bias_ids_ptr + slot * MAX_BIAS + j, mask=j < n_bias, other=0)
                    bias = tl.load(bias_values_ptr + slot * MAX_BIAS + j, mask=j < n_bias, other=0.0)
                    tl.atomic_add(x_ptr + ids, bias, mask=j < n_bias)
                tl.debug_barrier()
                # 2. Repetition over the distinct tokens so far: x / r where x > 0, else x * r.
                rep = tl.load(repetition_ptr + slot)
                if rep != 1.0:
                    _count(tokens, 0, n_tokens, counts, TILE)
                    tl.debug_barrier()
                    for i0 in range(0, n_tokens, TILE):
                        t, n = _take_counts(tokens, 0, n_tokens, counts, i0, TILE)
                        x = tl.load(x_ptr + t, mask=n > 0, other=0.0)
                        if PRECISE:
                            down = libdevice.div_rn(x, rep)
                        else:
                            down = x / rep
                        tl.store(x_ptr + t, tl.where(x > 0.0, down, x * rep), mask=n > 0)
                    tl.debug_barrier()
                # 3. Frequency and presence over the generated tokens: x - (f * count + p).
                f, p = tl.load(frequency_ptr + slot), tl.load(presence_ptr + slot)
                if (f != 0.0) | (p != 0.0):
                    _count(tokens, n_prompt, n_tokens, counts, TILE)
                    tl.debug_barrier()
                    for i0 in range(n_prompt, n_tokens, TILE):
                        t, n = _take_counts(tokens, n_prompt, n_tokens, counts, i0, TILE)
                        x = tl.load(x_ptr + t, mask=n > 0, other=0.0)
                        if PRECISE:  # two roundings, as the reference's fp32 product and sum (no FMA)
                            cut = libdevice.add_rn(libdevice.mul_rn(f, n.to(tl.float32)), p)
                        else:
                            cut = f * n.to(tl.float32) + p
                        tl.store(x_ptr + t, x - cut, mask=n > 0)
                    tl.debug_barrier()


def penalize_rows(logits, n_rows, sample_slot, slots: dict, counts, *, max_model_len: int, max_bias: int,
                  programs: int, precise: bool) -> None:  # fmt: skip
    """Every penalized row among the step's sample rows (n_rows [1]); `slots`: DeviceState's per-slot
    tensors by name; `counts` [S * V] int32, all 0 (and left so). Capturable: no host sync."""
    S, V = logits.shape
    _penalties_kernel[(max(1, min(S, programs)),)](
        logits, logits.stride(0), n_rows, sample_slot, slots["penalized"], slots["presence_penalty"],
        slots["frequency_penalty"], slots["repetition_penalty"], slots["n_bias"], slots["bias_ids"],
        slots["bias_values"], slots["token_ids"], slots["num_tokens"], slots["prompt_len"], counts, V,
        MAX_MODEL_LEN=max_model_len, MAX_BIAS=max_bias, TILE=TOKEN_TILE, PRECISE=precise, num_warps=4,
    )  # fmt: skip
