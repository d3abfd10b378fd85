"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named fp32 weights, + tokenizer.

Read through the `gguf` package's memory-mapped reader; quantized tensors are dequantized with
`gguf.quants.dequantize`, or, when the caller keeps them quantized, Q4_0/Q4_1/Q8_0 matrices are
decoded into their integer codes and block scales (`GroupCodes`, model/quantized_linear.py). Two llama.cpp conventions are undone here: tensor shapes are stored in
ggml order (innermost first; the reader's numpy views are already in torch order), and for the
llama family the converter permuted the rows of q/k so that RoPE pairs are adjacent (GPT-J style)
rather than half a head apart (the HF/NeoX style our model uses).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from blink_appliance.model.config import ModelConfig, RopeScaling
from blink_appliance.model.gguf_file import field_value, open_gguf
from blink_appliance.model.quantized_linear import GroupCodes

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

    from blink_appliance.model.tokenizer import Tokenizer

# GGUF general.architecture -> our arch.
_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose converter permuted q/k rows for ggml's RoPE (llama.cpp's LlamaModel and subclasses).
_PERMUTED_QK = {"llama", "mistral"}

SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.x stores its RoPE scaling as a `rope_freqs` tensor of per-frequency divisors, not as
# metadata; we recognise it as the published llama3 scaling with these band edges.
_LLAMA3_BANDS = ((1.0, 4.0, 8192),)


def _required(reader: GGUFReader, key: str) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value


def architecture(reader: GGUFReader) -> str:
    gguf_arch = _required(reader, "general.architecture")
    if gguf_arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {gguf_arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    return gguf_arch


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    arch = architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key {arch}.{name!r} is missing")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF: {arch}.attention.value_length differs from key_length; not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ggml order: [hidden, vocab]

    theta = float(key("rope.freq_base", 10000.0))
    eos_ids = tuple(
        dict.fromkeys(
            int(v)
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (v := field_value(reader, f"tokenizer.ggml.{k}")) is not None
        )
    )
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        arch=_ARCHS[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=None,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )
    scaling = _rope_scaling(reader, arch, config, tensors.get("rope_freqs.weight"))
    if scaling is not None:
        config = replace(config, rope_scaling=scaling)
    return config


def _rope_scaling(
    reader: GGUFReader, arch: str, config: ModelConfig, rope_freqs: ReaderTensor | None
) -> RopeScaling | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(
            f"GGUF: {arch}.rope.scaling.type {kind!r} is not supported (supported: none, llama3)"
        )
    dims = field_value(reader, f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != config.head_dim:
        raise ValueError(
            f"GGUF: partial RoPE ({arch}.rope.dimension_count={dims} < head_dim) is not supported"
        )
    if rope_freqs is None:
        return None
    from blink_appliance.model.llama import rope_inv_freq

    divisors = torch.from_numpy(np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1).copy())
    base = rope_inv_freq(config)
    target = base / divisors
    factor = float(divisors.max())
    for low, high, original in _LLAMA3_BANDS:
        candidate = RopeScaling(factor, low, high, original)
        got = rope_inv_freq(replace(config, rope_scaling=candidate))
        if torch.allclose(got, target, rtol=1e-4, atol=0.0):
            return candidate
    raise ValueError(
        "GGUF: tensor 'rope_freqs.weight' does not match llama3 RoPE scaling with the published band "
        f"edges (factor={factor}); this frequency scaling is not supported"
    )


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None for tensors the model does not carry."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, d/2, 1, d/2+1, ...) -> (0, 1, ..., d-1)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """fp32 numpy array in torch order ([out, in] for matrices)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_QUANTS:
        raise ValueError(
            f"GGUF tensor {tensor.name!r}: quantization type {qtype.name} is not supported "
            f"(supported: {', '.join(SUPPORTED_QUANTS)})"
        )
    if qtype == GGMLQuantizationType.F32:
        out = np.array(tensor.data, dtype=np.float32)  # a copy: the reader's view is of the read-only mmap
    else:
        out = dequantize(tensor.data, qtype)
    torch_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(out.reshape(torch_shape), dtype=np.float32)


# Block layouts (ggml-common.h): fp16 scale [, fp16 min], then the codes of 32 weights.
KEPT_QUANTS = ("Q4_0", "Q4_1", "Q8_0")


def group_codes(tensor: ReaderTensor) -> GroupCodes:
    """A Q4_0/Q4_1/Q8_0 matrix as codes + per-block scale/offset, exactly what it dequantizes to."""
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.tensor_type).name
    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows * cols // 32, -1)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32)
    offset = np.zeros_like(scale)
    if qtype == "Q8_0":
        codes = raw[:, 2:34].copy().view(np.int8)
    else:
        qs = raw[:, 4:20] if qtype == "Q4_1" else raw[:, 2:18]
        # Byte j holds weight j in its low nibble and weight j + 16 in its high one.
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)
        if qtype == "Q4_1":
            offset = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            codes = codes.astype(np.int8) - 8
    return GroupCodes(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
        torch.from_numpy(scale.reshape(rows, cols // 32)),
        torch.from_numpy(offset.reshape(rows, cols // 32)),
    )


def keeps_codes(tensor: ReaderTensor) -> bool:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(tensor.tensor_type).name in KEPT_QUANTS and len(tensor.shape) == 2


def load_quantized(reader: GGUFReader, config: ModelConfig) -> dict[str, GroupCodes]:
    """The Q4_0/Q4_1/Q8_0 matrices as codes, HF-named and with q/k rows in HF order."""
    arch = architecture(reader)
    out: dict[str, GroupCodes] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or not keeps_codes(t):
            continue
        codes = group_codes(t)
        if arch in _PERMUTED_QK:
            if name.endswith("q_proj.weight"):
                codes = codes.permute_rows(lambda w: unpermute_rope_rows(w, config.num_heads))
            elif name.endswith("k_proj.weight"):
                codes = codes.permute_rows(lambda w: unpermute_rope_rows(w, config.num_kv_heads))
        out[name] = codes
    return out


def load_weights(
    reader: GGUFReader, config: ModelConfig, skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights of every tensor but those named in skip (kept quantized elsewhere)."""
    arch = architecture(reader)
    wanted = [(t, name) for t in reader.tensors if (name := hf_name(t.name)) is not None and name not in skip]
    unknown = [t.name for t in reader.tensors if hf_name(t.name) is None and t.name != "rope_freqs.weight"]
    if unknown:
        raise ValueError(f"GGUF: tensors the {arch} model does not carry: {unknown[:5]}")
    from gguf import GGMLQuantizationType

    for t, _ in wanted:  # fail on an unsupported type before spending time on the rest
        if GGMLQuantizationType(t.tensor_type).name not in SUPPORTED_QUANTS:
            dequantize_tensor(t)  # raises the error naming the type

    # numpy's dequantization releases the GIL in its bulk ops, so threads overlap usefully.
    with ThreadPoolExecutor(max_workers=min(4, len(wanted) or 1)) as pool:
        arrays = list(pool.map(lambda tn: dequantize_tensor(tn[0]), wanted))

    weights: dict[str, torch.Tensor] = {}
    for (_, name), array in zip(wanted, arrays, strict=True):
        w = torch.from_numpy(array)
        if arch in _PERMUTED_QK:
            if name.endswith("q_proj.weight"):
                w = unpermute_rope_rows(w, config.num_heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_rope_rows(w, config.num_kv_heads)
        weights[name] = w.contiguous()
    return weights


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, HF-named fp32 weights and the tokenizer of a GGUF checkpoint."""
    config, weights, _, tokenizer = load_gguf_quantized(path, keep=False)
    return config, weights, tokenizer


def load_gguf_quantized(
    path: str | Path, *, keep: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, GroupCodes], Tokenizer]:
    """Like load_gguf, but (keep) Q4_0/Q4_1/Q8_0 matrices come back as codes, not fp32 weights."""
    from blink_appliance.model.tokenizer import Tokenizer

    reader = open_gguf(path)
    config = config_from_gguf(reader)
    tokenizer = Tokenizer.from_gguf_reader(reader)
    quantized = load_quantized(reader, config) if keep else {}
    weights = load_weights(reader, config, skip=frozenset(quantized))
    return config, weights, quantized, tokenizer
