"""Random weights with real architectures, deterministic from a seed: for benchmarks and tests."""

from __future__ import annotations

import torch

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.presets import weight_shapes


def random_weights(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: N(0, 0.02) matrices, norms near 1, small biases.

    Drawn in fp32 on the CPU generator (so every device gets the same values), then moved.
    For very large presets on a GPU, prefer `device="cuda"` draws in the benchmark itself.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            w = 0.02 * torch.randn(shape, generator=gen)
        else:
            w = 0.02 * torch.randn(shape, generator=gen)
        weights[name] = w.to(device=device, dtype=dtype)
    return weights
