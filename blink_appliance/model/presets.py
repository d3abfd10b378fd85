"""The dummy: presets: real architectures by name, and the parameter shapes of any architecture.

Torch-free, so that the profile's plan and the front end (a dummy model's vocabulary) can use them
without loading torch; dummy.py draws random weights of these shapes.
"""

from __future__ import annotations

from blink_appliance.model.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# fmt: off
PRESETS: dict[str, ModelConfig] = {
    # Small enough for unit tests; GQA, untied head, several RoPE frequencies.
    "tiny": ModelConfig(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=1024,
        eos_token_ids=(2,), bos_token_id=1,
    ),
    "tiny-qwen2": ModelConfig(
        arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=1024, attention_bias=True, tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    "tiny-qwen3": ModelConfig(
        arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=1024, qk_norm=True, tie_word_embeddings=True, eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_ROPE), max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_ROPE), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=40960, qk_norm=True, tie_word_embeddings=True, eos_token_ids=(151645,),
    ),
}
# fmt: on


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy preset {name!r}; known: {', '.join(PRESETS)}") from None


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of LlamaModel(config), by HF name."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes
