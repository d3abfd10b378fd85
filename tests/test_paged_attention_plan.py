"""The reference model's paged attention (indices planned once per step) against a per-token loop.

The batch mixes what the CPU engine and the GPU loop's static inputs produce: decode tokens, prefill
chunks of different lengths starting mid-sequence, a one-token first chunk, a sequence entry with no
queries, and padding rows at the end (slot -1) whose output must be zero and whose K/V go nowhere.
"""

from __future__ import annotations

import torch

from blink_appliance.model.kv_cache import ForwardBatch
from blink_appliance.model.llama import paged_attention, plan_attention

BLOCK, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 4, 32, 4, 2, 8


def _batch() -> ForwardBatch:
    g = torch.Generator().manual_seed(5)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    # (tokens already in the cache, queries this step); (0, 0) is an unused sequence entry.
    runs = [(8, 1), (0, 0), (3, 5), (0, 1), (0, 3), (13, 1)]
    positions, slots, starts, ctx, tables = [], [], [0], [], []
    for cached, n_q in runs:
        n = cached + n_q
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        for p in range(cached, n):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(len(positions))
        ctx.append(n)
        tables.append(table + [-1] * (4 - len(table)))
    padding = 2
    return ForwardBatch(
        input_ids=torch.zeros(len(positions) + padding, dtype=torch.int64),
        positions=torch.tensor(positions + [0] * padding),
        slot_mapping=torch.tensor(slots + [-1] * padding),
        query_start=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        sample_rows=torch.tensor([s - 1 for s in starts[1:] if s > 0]),
    )


def _per_token_reference(q, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
    out = torch.zeros_like(q)
    qs = batch.query_start.tolist()
    for s in range(batch.num_seqs):
        table = batch.block_tables[s].tolist()
        for t in range(qs[s], qs[s + 1]):
            p = int(batch.positions[t])
            blocks = [table[j // BLOCK] for j in range(p + 1)]
            keys = torch.stack([k_cache[b, j % BLOCK] for j, b in enumerate(blocks)])  # [p+1, kv, D]
            values = torch.stack([v_cache[b, j % BLOCK] for j, b in enumerate(blocks)])
            for h in range(HEADS):
                kv_h = h // (HEADS // KV_HEADS)
                w = torch.softmax(keys[:, kv_h] @ q[t, h] * DIM**-0.5, dim=0)
                out[t, h] = w @ values[:, kv_h]
    return out


def test_paged_attention_matches_per_token_loop():
    batch = _batch()
    g = torch.Generator().manual_seed(9)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)

    got = paged_attention(q, k_cache, v_cache, plan_attention(batch, BLOCK, torch.float32), scale=DIM**-0.5)
    want = _per_token_reference(q, k_cache, v_cache, batch)
    assert (got - want).abs().max().item() < 1e-5
    assert not got[-2:].any()  # padding rows


def test_plan_writes_only_real_rows():
    batch = _batch()
    plan = plan_attention(batch, BLOCK, torch.float32)
    real = batch.num_tokens - 2
    assert plan.write_rows.tolist() == list(range(real))
    assert plan.write_slots.tolist() == batch.slot_mapping[:real].tolist()
    assert [g.key_slots.shape[0] for g in plan.groups] == [3, 2]  # decode group, then prefill group

    unpadded = ForwardBatch(**{**batch.__dict__, "slot_mapping": batch.slot_mapping[:real]})
    assert (
        plan_attention(unpadded, BLOCK, torch.float32).write_rows is None
    )  # every row writes: no gather per layer
