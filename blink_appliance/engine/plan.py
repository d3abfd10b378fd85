"""The resolved plan: a model's profile plus its architecture as concrete numbers.

Weights bytes, bytes per KV block, the number of KV blocks the memory budget holds and the request
limits. Both engines size themselves from it (the GPU loop through engine/loop/geometry.py);
`blink-appliance check` prints it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.presets import weight_shapes
from blink_appliance.profile import ModelSection, Profile, ProfileError

GIB = 1 << 30


@dataclass(frozen=True)
class ModelPlan:
    """Concrete numbers for one model, from its profile and its architecture."""

    name: str
    source: str
    dtype: str
    device: str
    weights_bytes: int
    kv_bytes: int  # what the blocks actually take (<= the budget)
    kv_budget_bytes: int
    bytes_per_block: int
    num_kv_blocks: int
    block_size: int
    max_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    max_prompt_tokens: int
    max_output_tokens: int
    rank_devices: tuple[str, ...] = ()  # tensor parallelism: weights and KV are per rank, on each

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def describe(self) -> str:
        return "\n".join(
            [
                f"model {self.name!r} (source {self.source}, {self.dtype} on {self.device})"
                + (f", per rank of {', '.join(self.rank_devices)}" if self.rank_devices else ""),
                f"  weights        {_fmt_bytes(self.weights_bytes)}",
                f"  kv cache       {_fmt_bytes(self.kv_bytes)} of a {_fmt_bytes(self.kv_budget_bytes)} budget"
                f" -> {self.num_kv_blocks} blocks x {self.block_size} tokens"
                f" ({self.kv_tokens} tokens, {_fmt_bytes(self.bytes_per_block)} per block)",
                f"  max_seqs       {self.max_seqs}",
                f"  max_model_len  {self.max_model_len} (prompt <= {self.max_prompt_tokens},"
                f" output <= {self.max_output_tokens})",
                f"  token budget   {self.max_num_batched_tokens} tokens per engine step",
            ]
        )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def weights_bytes(config: ModelConfig, dtype: str) -> int:
    return sum(math.prod(s) for s in weight_shapes(config).values()) * _itemsize(dtype)


def resolve_plan(
    model: ModelSection,
    config: ModelConfig,
    *,
    available_bytes: int | None = None,
    colocated_bytes: int = 0,
) -> ModelPlan:
    """Size the KV cache and check the limits against the architecture; errors name the model's keys.

    `kv_fraction` is a fraction of the memory left after the weights: host RAM available now
    (psutil) for device "cpu", the GPU's free memory now for "cuda:N" (so the plan of a CUDA profile
    with kv_fraction needs that GPU; kv_budget_gib does not); `available_bytes` overrides that
    reading (tests, and an engine that read it once before loading any of its models).
    `colocated_bytes`: what the other models on the same device take of that memory (their
    weights and fixed KV budgets); the fractions share what is left after it.
    """
    # torch on first use: `blink-appliance check` imports this module before it loads a model.
    import torch

    from blink_appliance.model.kv_cache import PagedKVCache

    if model.max_model_len > config.max_position_embeddings:
        raise ProfileError(
            f"{model.key('max_model_len')}: {model.max_model_len} exceeds the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    if model.tensor_parallel > 1:  # sized per rank: each GPU holds its share of heads and MLP
        from blink_appliance.model.tensor_parallel import shard_config

        try:
            config = shard_config(config, model.tensor_parallel)
        except ValueError as e:
            raise ProfileError(f"{model.key('tensor_parallel')}: {e}") from None
    w_bytes = weights_bytes(config, model.dtype)
    per_block = PagedKVCache.bytes_per_block(
        config.num_layers, model.block_size, config.num_kv_heads, config.head_dim, getattr(torch, model.dtype)
    )
    if model.kv_budget_gib is not None:
        budget = int(model.kv_budget_gib * GIB)
        budget_key = model.key("kv_budget_gib")
    else:
        assert model.kv_fraction is not None
        budget_key = model.key("kv_fraction", replica=True)  # of this replica's device
        avail = free_bytes(model.device, budget_key) if available_bytes is None else available_bytes
        budget = int(model.kv_fraction * max(0, avail - w_bytes - colocated_bytes))
    # Never more blocks than max_seqs sequences of max_model_len can use.
    blocks_per_seq = -(-model.max_model_len // model.block_size)
    num_blocks = min(budget // per_block, model.max_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ProfileError(
            f"{budget_key}: a budget of {_fmt_bytes(budget)} holds {budget // per_block} blocks of "
            f"{_fmt_bytes(per_block)}, fewer than one sequence of max_model_len={model.max_model_len} "
            f"needs ({blocks_per_seq})"
        )
    return ModelPlan(
        name=model.name,
        source=model.model_source,
        dtype=model.dtype,
        device=model.device,
        weights_bytes=w_bytes,
        kv_bytes=num_blocks * per_block,
        kv_budget_bytes=budget,
        bytes_per_block=per_block,
        num_kv_blocks=num_blocks,
        block_size=model.block_size,
        max_seqs=model.max_seqs,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=model.max_num_batched_tokens,
        max_prompt_tokens=model.prompt_limit,
        max_output_tokens=model.output_limit,
        rank_devices=tuple(model.rank_devices) if model.tensor_parallel > 1 else (),
    )


def resolve_plans(
    profile: Profile, configs: Mapping[int, ModelConfig], *, available_bytes: int | None = None
) -> dict[int, ModelPlan]:
    """The plans of the models in `configs` (by index). The models of one CUDA device share its
    memory: a fraction is of what is left after all their weights (and fixed kv_budget_gib), read
    once for all of them, before any of their weights is loaded."""
    taken = {
        i: weights_bytes(c, profile.models[i].dtype) + int((profile.models[i].kv_budget_gib or 0) * GIB)
        for i, c in configs.items()
    }
    free: dict[str, int] = {}
    plans = {}
    for i, config in configs.items():
        m = profile.models[i]
        others = [j for j in configs if j != i and m.device != "cpu" and profile.models[j].device == m.device]
        available = available_bytes
        if available is None and others and m.kv_fraction is not None:
            if m.device not in free:
                free[m.device] = free_bytes(m.device, m.key("kv_fraction"))
            available = free[m.device]
        plans[i] = resolve_plan(
            m,
            config,
            available_bytes=available,
            colocated_bytes=sum(taken[j] for j in others),
        )
    return plans


def free_bytes(device: str, key: str) -> int:
    """Memory free for weights + KV on `device` now."""
    if device == "cpu":
        return psutil.virtual_memory().available
    import torch

    index = int(device.split(":")[1])
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ProfileError(
            f"{key}: sizing the KV cache from free memory needs {device}, and this machine has "
            f"{found} CUDA device(s); set kv_budget_gib instead to plan without it"
        )
    return torch.cuda.mem_get_info(index)[0]
