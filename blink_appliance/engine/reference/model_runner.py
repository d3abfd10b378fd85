"""Runs one scheduled step: the model's forward over the paged KV cache, then the sampler."""

from __future__ import annotations

import torch

from blink_appliance.engine.reference.sampler import SamplingTensors, sample
from blink_appliance.engine.reference.scheduler import SchedulerOutput, build_forward_batch
from blink_appliance.model.kv_cache import PagedKVCache
from blink_appliance.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, num_kv_blocks: int, block_size: int) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        c = model.config
        self.block_size = block_size
        self.kv = PagedKVCache.allocate(
            c.num_layers, num_kv_blocks, block_size, c.num_kv_heads, c.head_dim, param.dtype, self.device
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int]:
        """Forward the step's chunks; return one sampled token per sampling chunk, in batch order."""
        batch = build_forward_batch(out.chunks, self.block_size, self.device)
        logits = self.model(batch, self.kv)
        sampling = out.sampling_chunks
        if not sampling:
            return []
        st = SamplingTensors.build(
            [c.seq.params for c in sampling],
            [c.seq.seed for c in sampling],
            [c.seq.num_output_tokens for c in sampling],
            self.device,
        )
        return sample(logits, st).tolist()
