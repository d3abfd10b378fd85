"""The paged KV cache and the per-step forward metadata (layout documented in docs/kv_layout.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKVCache:
    """K and V for every layer, in fixed-size blocks: `[num_layers, num_blocks, block_size, n_kv, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass
class ForwardBatch:
    """Everything one forward step needs besides weights and the cache (see docs/kv_layout.md)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    query_start: torch.Tensor  # [S+1] int32
    context_lens: torch.Tensor  # [S] int32, after this step's writes
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32, -1 padded
    sample_rows: torch.Tensor  # [R] int64

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
