"""Model weights from a source (model/sources.py): a Checkpoint, and the reference model built from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.sources import gguf_path, hf_directory, hf_tokenizer, parse_source

if TYPE_CHECKING:
    from blink_appliance.model.llama import LlamaModel
    from blink_appliance.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, fp32
    tokenizer: Tokenizer | None


def load_checkpoint(source: str, *, seed: int = 0) -> Checkpoint:
    kind, arg = parse_source(source)
    if kind == "dummy":
        from blink_appliance.model.loaders.dummy import random_weights
        from blink_appliance.model.presets import preset_config

        config = preset_config(arg)
        return Checkpoint(source, config, random_weights(config, seed=seed), tokenizer=None)
    if kind == "hf":
        from blink_appliance.model.loaders.hf import load_hf_dir

        directory = hf_directory(arg)
        config, weights = load_hf_dir(directory)
        return Checkpoint(source, config, weights, tokenizer=hf_tokenizer(directory))
    path = gguf_path(kind, arg)
    from blink_appliance.model.loaders.gguf_loader import load_gguf

    config, weights, tokenizer = load_gguf(path)
    return Checkpoint(source, config, weights, tokenizer)


def build_model(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaModel:
    from blink_appliance.model.llama import LlamaModel, rope_inv_freq

    with torch.device("meta"):
        model = LlamaModel(ckpt.config)
    model = model.to_empty(device=device)
    model.load_weights(ckpt.weights)
    model = model.to(dtype).eval()
    # RoPE frequencies stay fp32 whatever the weights' dtype (to_empty also left them unset).
    model.inv_freq = rope_inv_freq(ckpt.config).to(device)
    return model
