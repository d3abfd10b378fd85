"""Paged attention kernel vs a float64 torch reference: mixed prefill/decode, GQA, odd lengths,
sequences spanning many blocks, unused sequence slots, padding rows, poisoned outputs.

On a machine without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 must be
set before triton compiles anything, hence before the kernels import) at small shapes; with a GPU the
same cases run compiled at real head sizes.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.paged_attention import FusedRope, attention_grid, paged_attention  # noqa: E402
from blink_appliance.kernels.rope import rope_and_cache_write, rope_tables  # noqa: E402

from blink_appliance.model.config import ModelConfig  # noqa: E402
from blink_appliance.model.llama import rope_inv_freq  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def make_paged_case(
    runs: list[tuple[int, int]],
    max_seqs: int,
    num_tokens: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
):
    """runs: (tokens already cached, new tokens) per sequence. Blocks handed out scrambled."""
    blocks_needed = [-(-(c + n) // block_size) for c, n in runs]
    max_blocks = max(blocks_needed) + 2
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((max_seqs, max_blocks), -1, dtype=torch.int32)
    starts = [0]
    ctx = torch.zeros(max_seqs, dtype=torch.int32)
    for s, (cached, new) in enumerate(runs):
        for b in range(blocks_needed[s]):
            tables[s, b] = free.pop()
        starts.append(starts[-1] + new)
        ctx[s] = cached + new
    assert starts[-1] <= num_tokens
    query_start = torch.tensor(starts + [starts[-1]] * (max_seqs - len(runs)), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return query_start, ctx, tables, k, v


def reference_attention(q, k_cache, v_cache, query_start, ctx, tables, num_heads, num_kv_heads, scale):
    """float64, a sequence at a time: each query token's softmax over keys 0..its position (a causal
    mask over the sequence's whole context; vectorized, since the GPU cases' contexts are long)."""
    T = q.shape[0]
    D = k_cache.shape[-1]
    bs = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(T, num_heads, D, dtype=torch.float64)
    qd = q.double().view(T, num_heads, D)
    qs = query_start.tolist()
    for s in range(ctx.shape[0]):
        n_ctx, first, last = int(ctx[s]), qs[s], qs[s + 1]
        if last == first:
            continue
        kp = torch.arange(n_ctx)
        slots = tables[s, kp // bs].long() * bs + kp % bs
        keys = k_cache.reshape(-1, num_kv_heads, D)[slots].double().repeat_interleave(group, dim=1)
        vals = v_cache.reshape(-1, num_kv_heads, D)[slots].double().repeat_interleave(group, dim=1)
        positions = n_ctx - (last - torch.arange(first, last))  # [n]
        scores = torch.einsum("nhd,khd->hnk", qd[first:last], keys) * scale
        scores = scores.masked_fill(kp[None, None, :] > positions[None, :, None], float("-inf"))
        out[first:last] = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), vals)
    return out.view(T, num_heads * D)


CPU_CASES = [
    # (runs, max_seqs, T, block_size, heads, kv_heads, head_dim)
    ([(0, 7), (5, 1), (13, 1), (0, 1)], 6, 12, 4, 4, 2, 16),  # prefill + decodes, unused seqs, padding
    ([(9, 5), (37, 1), (0, 3)], 3, 9, 4, 6, 2, 16),  # chunk over a cached prefix, group of 3
    ([(61, 1), (0, 19)], 2, 20, 8, 4, 4, 32),  # many blocks; MHA; odd prefill longer than BLOCK_Q
    ([(0, 0), (3, 2)], 4, 5, 16, 8, 1, 16),  # an empty sequence before a real one; MQA
    # idle sequence slots (cached keys, no tokens this step) between active ones; max_seqs > T
    ([(3, 1), (5, 0), (0, 0), (7, 2), (9, 0), (1, 1)], 10, 6, 4, 4, 2, 16),
    ([(0, 0), (6, 1)], 3, 1, 4, 4, 2, 16),  # batch 1: a grid of one program per KV head and split
    ([(6, 1), (2, 1)], 2, 3, 4, 4, 2, 16),  # every sequence and the padding tail: the most runs a grid holds
]
GPU_CASES = [
    ([(0, 37), (100, 1), (511, 1), (7, 65), (0, 1)], 8, 128, 16, 32, 8, 64),
    ([(1000, 1)] * 8, 8, 8, 16, 32, 8, 128),
    ([(0, 300), (2047, 1), (33, 200)], 16, 512, 16, 32, 8, 128),
    ([(5, 3), (0, 77)], 4, 96, 32, 9, 3, 64),
    ([(300, 1) if s % 8 == 3 else (40, 0) for s in range(64)], 128, 8, 16, 32, 8, 64),  # idle slots
]


@pytest.mark.parametrize("case", GPU_CASES if GPU else CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if GPU else [torch.float32])
@pytest.mark.parametrize(("num_splits", "block_n"), [(1, 32), (1, 64), (3, 32), (4, 16)])
def test_paged_attention_matches_reference(case, dtype, num_splits, block_n):
    runs, max_seqs, T, bs, H, HKV, D = case
    gen = torch.Generator().manual_seed(hash((str(case), str(dtype), num_splits, block_n)) % 2**31)
    query_start, ctx, tables, k, v = make_paged_case(runs, max_seqs, T, bs, HKV, D, dtype, gen)
    # q as the leading part of a wider fused-QKV row, to exercise the row stride.
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=gen).to(dtype)
    q = qkv[:, : H * D]
    scale = D**-0.5
    ref = reference_attention(q, k, v, query_start, ctx, tables, H, HKV, scale)

    dev = lambda x: x.to(DEVICE)  # noqa: E731
    out = torch.full((T, H * D), float("nan"), dtype=dtype, device=DEVICE)
    qkv_d = dev(qkv)
    partials = None
    if num_splits > 1:  # poisoned scratch: the merge must read only what the splits wrote
        partials = tuple(
            torch.full((n,), float("nan"), device=DEVICE)
            for n in (num_splits * T * H * D, num_splits * T * H * 2)
        )
    paged_attention(
        qkv_d[:, : H * D], dev(k), dev(v), out, dev(query_start), dev(ctx), dev(tables), H, HKV, D, scale,
        block_n=block_n, num_splits=num_splits, partials=partials,
    )  # fmt: skip
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "unwritten (NaN) output rows"
    n_real = int(query_start[-1])
    assert (got[n_real:] == 0).all(), "padding rows must be zero"
    err = (got - ref).norm() / ref.norm()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert err < tol, f"relative error {err:.2e}"
    # Per-row check too: a single wrong row must not hide in the global norm.
    row_err = (got[:n_real] - ref[:n_real]).abs().amax(dim=1) / ref[:n_real].abs().amax(dim=1)
    assert row_err.max() < (5e-2 if dtype == torch.bfloat16 else 1e-4)


def _programs_needed(run_lens: tuple[int, ...], num_tokens: int, block_q: int) -> int:
    """The kernel's numbering: a non-empty run (a sequence, then the padding tail) starts at
    query_start // block_q plus the non-empty runs before it, and takes one program per query block."""
    start = rank = needed = 0
    for n in (*run_lens, num_tokens - sum(run_lens)):
        if n:
            needed = max(needed, start // block_q + rank + -(-n // block_q))
            rank += 1
        start += n
    return needed


@pytest.mark.parametrize("block_q", [1, 2, 4, 8])
def test_attention_grid_is_the_most_any_layout_needs(block_q):
    """Every split of T tokens over max_seqs sequences (empty ones too) and the padding tail gets a
    program for each of its query blocks, and the worst layout uses them all: no idle programs."""
    for T in range(1, 11):
        for S in range(1, 5):
            layouts = (c for c in itertools.product(range(T + 1), repeat=S) if sum(c) <= T)
            worst = max(_programs_needed(c, T, block_q) for c in layouts)
            assert attention_grid(T, S, block_q, 1) == (worst, 1), (T, S)


def test_paged_attention_rejects_bad_shapes():
    q = torch.zeros(4, 4 * 16)
    kv = torch.zeros(2, 4, 3, 16)
    with pytest.raises(ValueError, match="do not split"):
        paged_attention(
            q,
            kv,
            kv,
            q.clone(),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32),
            4,
            3,
            16,
            0.25,
        )


def _step_inputs(runs, query_start, ctx, tables, T, bs):
    """positions and slot_mapping of the step's tokens, as the scheduler writes them (padding: 0, -1)."""
    positions = torch.zeros(T, dtype=torch.int64)
    slots = torch.full((T,), -1, dtype=torch.int64)
    qs = query_start.tolist()
    for s in range(len(runs)):
        for t in range(qs[s], qs[s + 1]):
            p = int(ctx[s]) - (qs[s + 1] - t)
            positions[t] = p
            slots[t] = int(tables[s, p // bs]) * bs + p % bs
    return positions, slots


@pytest.mark.parametrize("case", GPU_CASES if GPU else CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32] if GPU else [torch.float32])
@pytest.mark.parametrize(
    ("num_splits", "block_n", "source"),
    [(1, 32, "qkv"), (1, 16, "parts"), (3, 16, "parts"), (8, 16, "qkv")],  # 8: most splits past the context
)
def test_fused_rope_matches_the_rope_kernel_then_attention(case, dtype, num_splits, block_n, source):
    """FusedRope: the attention rotates q and this step's keys itself and writes the step's K/V. Same
    output and the same cache as kernels/rope.py followed by the plain attention, without ever reading
    the new slots (they are NaN-poisoned here), and no slot written but the step's."""
    runs, max_seqs, T, bs, H, HKV, D = case
    gen = torch.Generator().manual_seed(hash((str(case), str(dtype), num_splits, source)) % 2**31)
    query_start, ctx, tables, k, v = make_paged_case(runs, max_seqs, T, bs, HKV, D, dtype, gen)
    positions, slots = _step_inputs(runs, query_start, ctx, tables, T, bs)
    width = (H + 2 * HKV) * D
    extra = {}
    qkv = torch.randn(T, width, generator=gen).to(dtype)
    if source == "parts":  # the Triton QKV GEMM's split-K partials plus the bias
        extra = dict(
            qkv_parts=torch.randn(2, T, width, generator=gen), qkv_bias=torch.randn(width, generator=gen)
        )
    cfg = ModelConfig(
        arch="llama", vocab_size=32, hidden_size=H * D, intermediate_size=32, num_layers=1, num_heads=H, num_kv_heads=HKV,
        head_dim=D, rope_theta=10000.0,
    )  # fmt: skip
    cos, sin = rope_tables(rope_inv_freq(cfg), 4096, DEVICE)
    dev = lambda x: x.clone().to(DEVICE)  # noqa: E731  (a copy: both paths write into theirs)
    extra = {name: dev(x) for name, x in extra.items()}
    scale = D**-0.5

    # The two-kernel path.
    k_want, v_want, qkv_want = dev(k), dev(v), dev(qkv)
    rope_and_cache_write(qkv_want, dev(positions), dev(slots), cos, sin, k_want, v_want, H, HKV, D, **extra)
    want = torch.zeros(T, H * D, dtype=dtype, device=DEVICE)
    paged_attention(
        qkv_want[:, : H * D], k_want, v_want, want, dev(query_start), dev(ctx), dev(tables), H, HKV, D, scale,
        block_n=block_n, num_splits=num_splits,
    )  # fmt: skip

    # Fused: the step's slots poisoned, qkv poisoned too when the partials carry the row.
    k_got, v_got = dev(k), dev(v)
    new = slots[slots >= 0]
    k_got.view(-1, HKV, D)[dev(new)] = float("nan")
    v_got.view(-1, HKV, D)[dev(new)] = float("nan")
    qkv_got = dev(qkv)
    if source == "parts":
        qkv_got.fill_(float("nan"))
    got = torch.full((T, H * D), float("nan"), dtype=dtype, device=DEVICE)
    paged_attention(
        qkv_got, k_got, v_got, got, dev(query_start), dev(ctx), dev(tables), H, HKV, D, scale, block_n=block_n,
        num_splits=num_splits, rope=FusedRope(dev(slots), cos, sin, **extra),
    )  # fmt: skip

    assert torch.isfinite(got).all(), "read a poisoned slot or left a row unwritten"
    n_real = int(query_start[-1])
    assert (got[n_real:] == 0).all()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < tol, f"relative error {err:.2e} against rope + attention"
    # The cache: the step's slots hold what the RoPE kernel writes; every other slot is untouched.
    flat = lambda c: c.cpu().view(-1, HKV, D).double()  # noqa: E731
    assert torch.allclose(flat(k_got), flat(k_want), rtol=tol, atol=tol)
    assert torch.equal(flat(v_got), flat(v_want))


def test_fused_rope_refuses_mismatched_inputs():
    H, HKV, D, T = 4, 2, 16, 3
    width = (H + 2 * HKV) * D
    kv = torch.zeros(2, 4, HKV, D)
    meta = (
        torch.tensor([0, T], dtype=torch.int32),
        torch.tensor([T], dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.int32),
    )
    cos = sin = torch.zeros(8, D // 2)
    slots = torch.zeros(T, dtype=torch.int64)

    def call(qkv, rope):
        paged_attention(qkv, kv, kv, torch.zeros(T, H * D), *meta, H, HKV, D, 0.25, rope=rope)

    with pytest.raises(ValueError, match="whole QKV output"):
        call(torch.zeros(T, H * D), FusedRope(slots, cos, sin))
    with pytest.raises(ValueError, match="must be fp32"):
        call(torch.zeros(T, width), FusedRope(slots, cos, sin, qkv_parts=torch.zeros(2, T + 1, width)))
    with pytest.raises(ValueError, match="qkv_bias goes with qkv_parts"):
        call(torch.zeros(T, width), FusedRope(slots, cos, sin, qkv_bias=torch.zeros(width)))
    with pytest.raises(ValueError, match="cos/sin"):
        call(torch.zeros(T, width), FusedRope(slots, torch.zeros(8, D), torch.zeros(8, D)))
    with pytest.raises(ValueError, match="slot_mapping"):
        call(torch.zeros(T, width), FusedRope(slots[:1], cos, sin))
