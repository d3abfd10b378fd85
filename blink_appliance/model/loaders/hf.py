"""Hugging Face checkpoints: config.json + *.safetensors (sharded too) + tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from blink_appliance.model.config import ModelConfig, RopeScaling

# HF model_type -> our arch name.
_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 nests RoPE settings in `rope_parameters`; older configs use rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"config.json: rope scaling type {rope_type!r} is not supported (supported: llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in _ARCHS:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(_ARCHS)})"
        )
    arch = _ARCHS[model_type]
    if cfg.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if arch in ("llama", "mistral") and cfg.get("attention_bias"):
        # Llama's attention_bias also puts a bias on o_proj, which the model does not carry.
        raise ValueError("config.json: attention_bias=true is not supported for llama/mistral")
    if arch == "mistral" and cfg.get("sliding_window"):
        raise ValueError(
            f"config.json: sliding_window={cfg['sliding_window']} (sliding-window attention) is not supported"
        )
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    # Tied checkpoints sometimes still carry lm_head; rotary caches are not parameters.
    return {k: v.float() for k, v in weights.items() if "rotary_emb" not in k}


def load_hf_dir(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (an hf: source needs config.json)")
    config = config_from_hf(json.loads(config_path.read_text()))
    weights = load_hf_weights(directory)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights
