"""Helpers for tests that drive the model directly: build ForwardBatches over a paged cache."""

from __future__ import annotations

import torch

from blink_appliance.model.kv_cache import ForwardBatch


class PagedSequences:
    """Hands out blocks (in a scrambled order, to catch layout bugs) and builds ForwardBatches."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """chunks: (seq_id, new token ids) in batch order; every sequence samples its last token."""
        ids, pos, slots, starts, ctx, tables, rows = [], [], [], [0], [], [], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            for i, t in enumerate(tokens):
                p = start + i
                while p // self.block_size >= len(table):
                    table.append(self.free.pop())
                ids.append(t)
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[seq] = start + len(tokens)
            starts.append(len(ids))
            ctx.append(self.lens[seq])
            tables.append(table + [-1] * (self.max_blocks - len(table)))
            rows.append(len(ids) - 1)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=torch.tensor(starts, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            sample_rows=torch.tensor(rows, dtype=torch.int64),
        )
