"""Triton kernels of the GPU loop's logprobs (engine/loop/logprobs.py): for each sample row whose
request asked, the sampled token's log-probability and the row's N most likely tokens, written into
the ring's logprob area where the request's rows are (docs/protocol.md, "Logprob area").

The distribution is the reference's (engine/reference/logprobs.py): log-softmax of logits /
temperature (greedy rows: / 1). Two launches, both persistent over the step's rows:
- `_chunk_kernel`, per (row, vocabulary chunk): the chunk's max and sum of exp(x - max), and its N
  largest values with their ids (descending, ties by lower id);
- `_row_kernel`, per row: the logsumexp from the chunks' partials, then the row's N largest from the
  chunks' candidates, and the ring stores. Every thread fences its ring stores at system scope, so
  they reach the host before the commit kernel, launched after this one, publishes the token.
"""

from __future__ import annotations

import triton
import triton.language as tl
from blink_appliance.kernels.ring_access import fence_sys
from blink_appliance.kernels.sampling import _exp, _log, scaled


@triton.jit
def _scaled(raw, t, PRECISE: tl.constexpr):
    """logits / temperature, rounded as torch rounds it (greedy rows divide by 1)."""
    return scaled(raw, tl.where(t > 0.0, t, 1.0), PRECISE)


@triton.jit
def _top_n(r, sample_slot_ptr, lp_top_n_ptr):
    """Alternatives row r's request asked for; -1 when it asked for no logprobs (or r is unused)."""
    slot = tl.load(sample_slot_ptr + r)
    return tl.where(slot >= 0, tl.load(lp_top_n_ptr + tl.maximum(slot, 0)), -1)


@triton.jit
def _chunk_kernel(
    logits_ptr, stride, n_rows_ptr, sample_slot_ptr, lp_top_n_ptr, temperature_ptr,
    part_max_ptr, part_sum_ptr, cand_value_ptr, cand_index_ptr, V, n_chunks,
    CHUNK: tl.constexpr, MAX_N: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    n_items = tl.load(n_rows_ptr) * n_chunks
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        r = item // n_chunks
        n = _top_n(r, sample_slot_ptr, lp_top_n_ptr)
        if n >= 0:
            c = item % n_chunks
            idx = c * CHUNK + tl.arange(0, CHUNK)
            inb = idx < V
            raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=0.0)
            x = tl.where(inb, _scaled(raw, tl.load(temperature_ptr + r), PRECISE), float("-inf"))
            hi = tl.max(x, 0)
            out = r * n_chunks + c
            tl.store(part_max_ptr + out, hi)
            tl.store(part_sum_ptr + out, tl.sum(tl.where(inb, _exp(x - hi, PRECISE), 0.0), 0))
            for j in range(n):  # the chunk's n largest, taken one at a time (argmax: lowest id first)
                best = tl.argmax(x, 0)
                tl.store(cand_value_ptr + out * MAX_N + j, tl.max(x, 0))
                tl.store(cand_index_ptr + out * MAX_N + j, c * CHUNK + best)
                x = tl.where(tl.arange(0, CHUNK) == best, float("-inf"), x)


@triton.jit
def _row_kernel(
    logits_ptr, stride, n_rows_ptr, sample_slot_ptr, lp_top_n_ptr, lp_offset_ptr, temperature_ptr,
    output_index_ptr, sampled_ptr, part_max_ptr, part_sum_ptr, cand_value_ptr, cand_index_ptr, ring_ptr,
    n_chunks, OFF_LOGPROBS: tl.constexpr, MAX_N: tl.constexpr, BLOCK_C: tl.constexpr,
    PRECISE: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    for r in range(tl.program_id(0), tl.load(n_rows_ptr), tl.num_programs(0)):
        n = _top_n(r, sample_slot_ptr, lp_top_n_ptr)
        if n >= 0:
            slot = tl.load(sample_slot_ptr + r)
            cc = tl.arange(0, BLOCK_C)
            part_max = tl.load(part_max_ptr + r * n_chunks + cc, mask=cc < n_chunks, other=float("-inf"))
            part_sum = tl.load(part_sum_ptr + r * n_chunks + cc, mask=cc < n_chunks, other=0.0)
            hi = tl.max(part_max, 0)
            lse = hi + _log(tl.sum(part_sum * _exp(part_max - hi, PRECISE), 0), PRECISE)
            token = tl.load(sampled_ptr + r)
            raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + token)
            chosen = _scaled(raw, tl.load(temperature_ptr + r), PRECISE) - lse
            # The request's row for this token: 1 + n pairs (token, logprob), from the first pair on.
            pair = tl.load(lp_offset_ptr + slot) + tl.load(output_index_ptr + r) * (1 + n)
            at = OFF_LOGPROBS + 8 * pair
            tl.store(ring_ptr.to(tl.pointer_type(tl.int32)) + at // 4, token.to(tl.int32))
            tl.store(ring_ptr.to(tl.pointer_type(tl.float32)) + at // 4 + 1, chosen)
            # Candidates: chunk-major, each chunk's in its own order, so the first of equal values
            # is the lowest id.
            jj = tl.arange(0, MAX_N)
            keep = (cc[:, None] < n_chunks) & (jj[None, :] < n)
            where = (r * n_chunks + cc[:, None]) * MAX_N + jj[None, :]
            value = tl.load(cand_value_ptr + where, mask=keep, other=float("-inf"))
            index = tl.load(cand_index_ptr + where, mask=keep, other=0)
            flat = cc[:, None] * MAX_N + jj[None, :]
            for j in range(n):
                top = tl.max(tl.max(value, 1), 0)
                first = tl.min(tl.min(tl.where(value == top, flat, BLOCK_C * MAX_N), 1), 0)
                pick = flat == first
                tl.store(ring_ptr.to(tl.pointer_type(tl.int32)) + at // 4 + 2 + 2 * j,
                         tl.sum(tl.sum(tl.where(pick, index, 0), 1), 0).to(tl.int32))  # fmt: skip
                tl.store(ring_ptr.to(tl.pointer_type(tl.float32)) + at // 4 + 3 + 2 * j, top - lse)
                value = tl.where(pick, float("-inf"), value)
    fence_sys(ON_GPU)


def row_logprobs(
    logits, n_rows, sample_slot, lp_top_n, lp_offset, temperature, output_index, sampled, scratch, ring, *,
    off_logprobs: int, chunk: int, max_n: int, programs: int, precise: bool, on_gpu: bool,
) -> None:  # fmt: skip
    """Both launches over the step's rows (n_rows [1]); `scratch` = (part_max, part_sum, cand_value,
    cand_index) sized [S * C] and [S * C * max_n]. Capturable: no host sync."""
    S, V = logits.shape
    C = triton.cdiv(V, chunk)
    part_max, part_sum, cand_value, cand_index = scratch
    _chunk_kernel[(max(1, min(S * C, programs)),)](
        logits, logits.stride(0), n_rows, sample_slot, lp_top_n, temperature, part_max, part_sum,
        cand_value, cand_index, V, C, CHUNK=chunk, MAX_N=max_n, PRECISE=precise, num_warps=4,
    )  # fmt: skip
    _row_kernel[(max(1, min(S, programs)),)](
        logits, logits.stride(0), n_rows, sample_slot, lp_top_n, lp_offset, temperature, output_index,
        sampled, part_max, part_sum, cand_value, cand_index, ring, C, OFF_LOGPROBS=off_logprobs,
        MAX_N=max_n, BLOCK_C=triton.next_power_of_2(C), PRECISE=precise, ON_GPU=on_gpu, num_warps=4,
    )  # fmt: skip
