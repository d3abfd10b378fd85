"""Write small synthetic GGUF files for tests, the way llama.cpp's converter lays them out.

Includes test-side quantizers for Q4_K and Q6_K (the `gguf` package only dequantizes those), written
from ggml's block layouts, so that the loader's dequantization is checked against the source values
rather than against itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers.pre_tokenizers import ByteLevel

QK_K = 256


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF half-split RoPE -> ggml interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 -> [rows, cols/256*144] bytes: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 nibbles."""
    rows, cols = x.shape
    blocks = x.reshape(-1, 8, 32).astype(np.float32)  # super-block of 8 sub-blocks of 32
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = blocks.max(-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = scale.max(-1, keepdims=True) / 63.0
    dmin = mins.max(-1, keepdims=True) / 63.0
    d = d.astype(np.float16).astype(np.float32)
    dmin = dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.clip(np.round((blocks + (dmin * mn)[..., None]) / np.where(step == 0, 1, step)), 0, 15).astype(
        np.uint8
    )

    packed_scales = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        packed_scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        packed_scales[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        packed_scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)  # 4 chunks of 64: low nibbles hold the first 32, high the next 32
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed_scales, qs], axis=1)
    return out.reshape(rows, cols // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 -> [rows, cols/256*210] bytes: ql (128), qh (64), int8 scales (16), d (f16)."""
    rows, cols = x.shape
    blocks = x.reshape(-1, 16, 16).astype(np.float32)  # super-block of 16 sub-blocks of 16
    sub = np.abs(blocks).max(-1) / 31.0
    d = (sub.max(-1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub / np.where(d == 0, 1, d)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.round(blocks / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # two halves of 128, each four runs of 32
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4), q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2
    )
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(rows, cols // QK_K * 210)


def encode_tensor(x: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """Array to hand GGUFWriter.add_tensor, and its raw_dtype."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F32:
        return x, None
    if qtype == Q.F16:
        return x.astype(np.float16), None
    if qtype == Q.Q4_K:
        return quantize_q4_k(x), qtype
    if qtype == Q.Q6_K:
        return quantize_q6_k(x), qtype
    return gguf.quants.quantize(x, qtype), qtype


def byte_level_vocab(
    extra_merges: list[tuple[str, str]], specials: list[str]
) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types, merges for a tiny byte-level BPE: 256 byte symbols, the merges' results, specials."""
    tokens = sorted(ByteLevel.alphabet())
    merges = []
    for a, b in extra_merges:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges


TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "Ġ"), ("l", "l"), ("he", "ll"), ("hell", "o")]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def hf_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, ff: int, vocab: int, layers: int, arch: str
) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ff, hidden),
            p + "mlp.up_proj.weight": (ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
        }
        if arch == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": (n * head_dim,)
                for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            }
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    return shapes


_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    ff: int = 256,
    layers: int = 1,
    tied: bool = True,
    matrix_qtype: Q = Q.F32,
    seed: int = 0,
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    add_bos: bool = False,
    extra_kv: dict[str, tuple[str, object]] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a GGUF; returns the HF-named source weights (before permutation/quantization)."""
    tokens, types, merges = byte_level_vocab(TINY_MERGES, TINY_SPECIALS)
    vocab = len(tokens)
    g = torch.Generator().manual_seed(seed)
    shapes = hf_shapes(hidden, heads, kv_heads, head_dim, ff, vocab, layers, arch)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    weights = {
        n: torch.randn(s, generator=g) * (0.02 if len(s) == 2 else 1.0) + (1.0 if "norm" in n else 0.0)
        for n, s in shapes.items()
    }

    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", tokenizer_model)
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|im_start|>"))
    w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
    w.add_uint32("tokenizer.ggml.eot_token_id", tokens.index("<|endoftext|>"))
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    w.add_string(
        "tokenizer.chat_template",
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    for key, (kind, value) in (extra_kv or {}).items():
        getattr(w, f"add_{kind}")(key, value)

    for name, t in weights.items():
        x = t.numpy()
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            x = permute_rope_rows(x, heads if "q_proj" in name else kv_heads)
        data, raw = encode_tensor(x, matrix_qtype if x.ndim == 2 else Q.F32)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    for name, (data, raw) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights
