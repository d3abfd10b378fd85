"""Model sources: `hf:<dir>`, `gguf:<file>`, `dummy:<preset>`, or a named model (pulled on first use)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from blink_appliance.model.config import ModelConfig

if TYPE_CHECKING:
    from blink_appliance.model.llama import LlamaModel
    from blink_appliance.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, fp32
    tokenizer: Tokenizer | None


def _split(source: str) -> tuple[str, str]:
    kind, sep, arg = source.partition(":")
    if sep and kind in ("hf", "gguf", "dummy"):
        if not arg:
            raise ValueError(f"model source {source!r}: nothing after '{kind}:'")
        return kind, arg
    from blink_appliance.model.loaders import model_registry

    if model_registry.is_named(source):
        return "named", source
    raise ValueError(
        f"unknown model source {source!r}: expected hf:<dir>, gguf:<file>, dummy:<preset> "
        f"or a named model ({', '.join(model_registry.known_names())})"
    )


def _gguf_path(kind: str, arg: str) -> Path:
    if kind == "named":
        from blink_appliance.model.loaders import model_registry

        return model_registry.resolve(arg)
    path = Path(arg)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def load_checkpoint(source: str, *, seed: int = 0) -> Checkpoint:
    kind, arg = _split(source)
    if kind == "dummy":
        from blink_appliance.model.loaders.dummy import preset_config, random_weights

        config = preset_config(arg)
        return Checkpoint(source, config, random_weights(config, seed=seed), tokenizer=None)
    if kind == "hf":
        from blink_appliance.model.loaders.hf import load_hf_dir

        directory = Path(arg)
        if not directory.is_dir():
            raise FileNotFoundError(f"hf: model directory not found: {directory}")
        config, weights = load_hf_dir(directory)
        return Checkpoint(source, config, weights, tokenizer=_hf_tokenizer(directory))
    path = _gguf_path(kind, arg)
    from blink_appliance.model.loaders.gguf_loader import load_gguf

    config, weights, tokenizer = load_gguf(path)
    return Checkpoint(source, config, weights, tokenizer)


def _hf_tokenizer(directory: Path) -> Tokenizer | None:
    if not (directory / "tokenizer.json").is_file():
        return None
    from blink_appliance.model.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(directory)


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer alone (for the front end), without reading weights. None for dummy models."""
    kind, arg = _split(source)
    if kind == "dummy":
        return None
    if kind == "hf":
        directory = Path(arg)
        if not directory.is_dir():
            raise FileNotFoundError(f"hf: model directory not found: {directory}")
        return _hf_tokenizer(directory)
    path = _gguf_path(kind, arg)
    from blink_appliance.model.loaders.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(path)


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
