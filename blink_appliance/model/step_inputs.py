"""The static per-step input buffers of the fixed-shape forward (model/gpu_forward.py): what the
scheduler (the host's, or the GPU loop's) writes before a step, laid out as docs/kv_layout.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """The per-step metadata the scheduler writes (docs/kv_layout.md), at fixed capacity.

    Token-level tensors hold `max_tokens` rows; a bucket T reads the first T. Unused sequence slots
    have query_start[s+1] == query_start[s] and context_lens[s] == 0; unused sample rows hold -1.
    """

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64, -1 = padding
    query_start: torch.Tensor  # [max_seqs + 1] int32
    context_lens: torch.Tensor  # [max_seqs] int32
    block_tables: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32
    sample_rows: torch.Tensor  # [max_seqs] int64, -1 = unused
    score_rows: torch.Tensor  # [score_rows] int64: token rows whose prompt logprobs are scored, -1 = unused

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        score_rows: int = 0,
    ) -> StepInputs:
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        inputs = cls(
            input_ids=torch.zeros(max_tokens, **i64),
            positions=torch.zeros(max_tokens, **i64),
            slot_mapping=torch.zeros(max_tokens, **i64),
            query_start=torch.zeros(max_seqs + 1, **i32),
            context_lens=torch.zeros(max_seqs, **i32),
            block_tables=torch.zeros(max_seqs, max_blocks_per_seq, **i32),
            sample_rows=torch.zeros(max_seqs, **i64),
            score_rows=torch.zeros(score_rows, **i64),
        )
        inputs.clear()
        return inputs

    def clear(self) -> None:
        """An empty step: no sequences, no writes, no samples (safe to run, e.g. to warm up)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.query_start.zero_()
        self.context_lens.zero_()
        self.block_tables.fill_(-1)
        self.sample_rows.fill_(-1)
        self.score_rows.fill_(-1)
