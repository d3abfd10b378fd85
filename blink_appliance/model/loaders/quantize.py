"""Swap a model's Linear/Embedding modules for ones that keep their GGUF codes (model/quantized_linear.py)."""

from __future__ import annotations

from torch import nn

from blink_appliance.model.llama import LlamaModel, RMSNorm
from blink_appliance.model.quantized_layers import (
    FastRMSNorm,
    FusedQuantizedLinear,
    QuantizedAttention,
    QuantizedMLP,
    can_fuse,
)
from blink_appliance.model.quantized_linear import GroupCodes, QuantizedEmbedding, QuantizedLinear


def swap_quantized(model: LlamaModel, codes: dict[str, GroupCodes]) -> None:
    """Replace each module whose `.weight` is in codes; the logits then come from the quantized head."""
    for name, w in codes.items():
        if not name.endswith(".weight"):
            raise ValueError(f"quantized tensor {name!r}: only weight matrices are kept quantized")
        parent_name, _, attr = name[: -len(".weight")].rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Linear):
            if (old.out_features, old.in_features) != w.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {w.shape} != model shape {tuple(old.weight.shape)}"
                )
            setattr(parent, attr, QuantizedLinear(w, bias=old.bias is not None))
        elif isinstance(old, nn.Embedding):
            if (old.num_embeddings, old.embedding_dim) != w.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {w.shape} != model shape {tuple(old.weight.shape)}"
                )
            setattr(parent, attr, QuantizedEmbedding(w))
        else:
            raise ValueError(f"{name}: a {type(old).__name__} cannot hold quantized weights")
    if model.config.tie_word_embeddings:
        if "model.embed_tokens.weight" in codes:
            # The tied table serves twice: rows for the lookup, int4 matmuls for the logits.
            model.output_head = QuantizedLinear(codes["model.embed_tokens.weight"])
    elif "lm_head.weight" in codes:
        model.output_head = model.lm_head
    fuse_layers(model, codes)


def fuse_layers(model: LlamaModel, codes: dict[str, GroupCodes]) -> None:
    """Swap in quantized_layers' modules: fused q/k/v and gate/up matmuls, fewer small ops.

    Runs on the meta-device model before its weights load; the fused modules keep the originals'
    names, so the checkpoint's remaining tensors (norms, biases) load where they did.
    """
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn = [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
        if all(n in codes for n in attn) and can_fuse([codes[n] for n in attn]):
            old = layer.self_attn
            qkv = FusedQuantizedLinear([old.q_proj, old.k_proj, old.v_proj], [codes[n] for n in attn])
            layer.self_attn = QuantizedAttention(model.config, old, qkv)
        mlp = [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up")]
        if all(n in codes for n in mlp) and can_fuse([codes[n] for n in mlp]):
            old = layer.mlp
            layer.mlp = QuantizedMLP(
                old, FusedQuantizedLinear([old.gate_proj, old.up_proj], [codes[n] for n in mlp])
            )
    for name, module in list(model.named_modules()):
        if type(module) is RMSNorm:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, FastRMSNorm(module.weight.shape[0], module.eps))
