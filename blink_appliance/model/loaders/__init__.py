"""Model weights from a source (model/sources.py): a Checkpoint, and the reference model built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from blink_appliance.model.config import ModelConfig
from blink_appliance.model.sources import gguf_path, hf_directory, hf_tokenizer, parse_source

if TYPE_CHECKING:
    from blink_appliance.model.llama import LlamaModel
    from blink_appliance.model.quantized_linear import GroupCodes
    from blink_appliance.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, fp32
    tokenizer: Tokenizer | None
    # Matrices kept as GGUF codes (load_checkpoint(quantized=True)); their names are not in weights.
    quantized: dict[str, GroupCodes] = field(default_factory=dict)


def load_checkpoint(source: str, *, seed: int = 0, quantized: bool = False) -> Checkpoint:
    """quantized: keep a GGUF's Q4_0/Q4_1/Q8_0 matrices as codes for the CPU's int4 kernels."""
    kind, arg = parse_source(source)
    if quantized and kind in ("dummy", "hf"):
        raise ValueError(
            f"quantized CPU weights need a GGUF source with Q4_0, Q4_1 or Q8_0 tensors; {source!r} "
            "holds float weights"
        )
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
    from blink_appliance.model.loaders.gguf_loader import load_gguf_quantized

    config, weights, codes, tokenizer = load_gguf_quantized(path, keep=quantized)
    if quantized and not codes:
        raise ValueError(f"quantized CPU weights: {source!r} has no Q4_0, Q4_1 or Q8_0 matrix to keep")
    return Checkpoint(source, config, weights, tokenizer, codes)


def _materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Module.to_empty, with torch.empty: empty_like of a meta tensor runs torch's Python refs, whose
    import (sympy, torch.fx) costs an engine start 1-3 s."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def build_model(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaModel:
    from blink_appliance.model.llama import LlamaModel, rope_inv_freq
    from blink_appliance.model.loaders.quantize import swap_quantized
    from blink_appliance.model.quantized_linear import QuantizedEmbedding

    with torch.device("meta"):
        model = LlamaModel(ckpt.config)
    if ckpt.quantized:
        if torch.device(device).type != "cpu":
            raise ValueError(f"quantized weights run on the CPU's int4 kernels only, not on {device}")
        swap_quantized(model, ckpt.quantized)
    _materialize(model, device)
    model.load_weights(ckpt.weights)
    model = model.to(dtype).eval()
    if isinstance(getattr(model.model, "embed_tokens", None), QuantizedEmbedding):
        model.model.embed_tokens.dtype = dtype  # a plain attribute, which .to(dtype) does not reach
    # RoPE frequencies stay fp32 whatever the weights' dtype (to_empty also left them unset).
    model.inv_freq = rope_inv_freq(ckpt.config).to(device)
    return model
