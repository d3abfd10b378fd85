"""GGUF loading: synthetic files for every quant type we claim and for the error paths, and the real
SmolLM2 GGUF against transformers' own GGUF loader (config, every tensor, logits through the paged cache).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from blink_appliance.model.kv_cache import PagedKVCache
from blink_appliance.model.loaders import build_model, load_checkpoint
from blink_appliance.model.loaders.gguf_loader import load_gguf, unpermute_rope_rows
from blink_appliance.model.tokenizer import Tokenizer
from tests.gguf_helpers import permute_rope_rows, write_gguf
from tests.model_helpers import PagedSequences

# Worst-case |dequant - source| as a fraction of the tensor's max |value|, from each format's step:
# 8-bit: amax/127/2; 4-bit blocks: (max-min)/15/2 <= amax/15; 6-bit: amax/31/2; plus scale rounding.
QUANT_TOL = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 4e-3,
    Q.Q8_0: 0.5 / 127 + 1e-3,
    Q.Q4_0: 1 / 8 + 1e-2,  # scale = -max/8: the far side of the block clamps at 7/8 of amax
    Q.Q4_1: 1 / 15 + 1e-2,
    Q.Q5_0: 1 / 16 + 1e-2,  # as Q4_0 with twice the levels
    Q.Q5_1: 1 / 31 + 1e-2,
    Q.Q4_K: 1 / 10,
    Q.Q6_K: 1 / 40,
}


@pytest.mark.parametrize("qtype", list(QUANT_TOL), ids=lambda q: q.name)
def test_dequantize_each_type_within_its_error(tmp_path, qtype):
    path = tmp_path / "m.gguf"
    source = write_gguf(path, matrix_qtype=qtype, tied=False)
    config, weights, _ = load_gguf(path)
    assert set(weights) == set(source)
    for name, src in source.items():
        got = weights[name]
        assert got.dtype == torch.float32 and got.shape == src.shape, name
        err = (got - src).abs().max().item()
        tol = QUANT_TOL[qtype if src.ndim == 2 else Q.F32] * src.abs().max().item()
        assert err <= tol + 1e-7, f"{name}: {qtype.name} error {err:.3g} > {tol:.3g}"
        if src.ndim == 2 and qtype != Q.F32:
            assert err > 0, f"{name}: {qtype.name} was not quantized at all"


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(4 * 16, 8)
    for heads in (1, 2, 4):
        permuted = torch.from_numpy(permute_rope_rows(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope_rows(permuted, heads), w)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_config_and_names_per_arch(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    source = write_gguf(
        path, arch=arch, hidden=64, heads=4, kv_heads=2, head_dim=32, ff=96, layers=2, tied=arch != "qwen3"
    )
    config, weights, tokenizer = load_gguf(path)
    assert (config.arch, config.hidden_size, config.intermediate_size, config.num_layers) == (arch, 64, 96, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    assert config.rope_theta == 50000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    assert config.max_position_embeddings == 4096 and config.rope_scaling is None
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    assert config.tie_word_embeddings == (arch != "qwen3")
    assert ("lm_head.weight" in weights) == (arch == "qwen3")
    assert config.vocab_size == tokenizer.vocab_size == source["model.embed_tokens.weight"].shape[0]
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_ids == tokenizer.eos_token_ids and len(config.eos_token_ids) == 2
    # F32 everywhere: exact, so q/k are un-permuted exactly for llama/mistral and untouched for qwen.
    assert set(weights) == set(source)
    for name, src in source.items():
        assert torch.equal(weights[name], src), name


def test_model_builds_from_synthetic_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, arch="qwen2", hidden=64, heads=4, kv_heads=2, head_dim=16, ff=96, layers=2)
    ckpt = load_checkpoint(f"gguf:{path}")
    model = build_model(ckpt)
    kv = PagedKVCache.allocate(2, 8, 4, 2, 16, torch.float32)
    logits = model(PagedSequences(8, 4, 4).batch([(0, [1, 2, 3, 4, 5])]), kv)
    assert logits.shape == (1, ckpt.config.vocab_size) and torch.isfinite(logits).all()


def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path):
    from blink_appliance.model.config import ModelConfig, RopeScaling
    from blink_appliance.model.llama import rope_inv_freq

    head_dim = 64
    plain = ModelConfig("llama", 10, 64, 64, 1, 1, 1, head_dim, rope_theta=50000.0)
    scaled = rope_inv_freq(
        ModelConfig(
            "llama",
            10,
            64,
            64,
            1,
            1,
            1,
            head_dim,
            rope_theta=50000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        )
    )
    divisors = (rope_inv_freq(plain) / scaled).numpy().astype(np.float32)
    path = tmp_path / "l3.gguf"
    write_gguf(
        path,
        hidden=64,
        heads=1,
        kv_heads=1,
        head_dim=head_dim,
        ff=64,
        extra_tensors={"rope_freqs.weight": (divisors, None)},
    )
    config, _, _ = load_gguf(path)
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)

    odd = tmp_path / "odd.gguf"
    write_gguf(
        odd,
        hidden=64,
        heads=1,
        kv_heads=1,
        head_dim=head_dim,
        ff=64,
        extra_tensors={"rope_freqs.weight": (np.linspace(1, 3, head_dim // 2, dtype=np.float32), None)},
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(odd)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(missing)


def test_not_a_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_gguf(bad)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, arch="gpt2", hidden=64, head_dim=16, ff=64)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


def test_unsupported_quant_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    # IQ4_NL: 18-byte blocks of 32 values; the bytes need not mean anything, the type is refused first.
    junk = np.random.default_rng(0).integers(0, 255, size=(256, 256 // 32 * 18), dtype=np.uint8)
    write_gguf(path, hidden=256, extra_tensors={"output.weight": (junk.copy(), Q.IQ4_NL)})
    with pytest.raises(ValueError, match="IQ4_NL is not supported"):
        load_gguf(path)


def test_unsupported_rope_scaling_type_is_named(tmp_path):
    path = tmp_path / "yarn.gguf"
    write_gguf(path, hidden=64, head_dim=16, ff=64, extra_kv={"llama.rope.scaling.type": ("string", "yarn")})
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        load_gguf(path)


def test_unknown_tensor_is_refused(tmp_path):
    path = tmp_path / "extra.gguf"
    write_gguf(
        path,
        hidden=64,
        head_dim=16,
        ff=64,
        extra_tensors={"blk.0.attn_output.bias": (np.zeros(64, np.float32), None)},
    )
    with pytest.raises(ValueError, match="attn_output.bias"):
        load_gguf(path)


# ---- the real SmolLM2 GGUF against transformers ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path, smollm2_transformers):
    return load_checkpoint(f"gguf:{smollm2_gguf_path}"), smollm2_transformers


@pytest.mark.slow
def test_smollm2_config_and_every_tensor_equal_transformers(smollm2):
    ckpt, hf = smollm2
    c, h = ckpt.config, hf.config
    assert c.arch == "llama" and c.vocab_size == h.vocab_size == 49152
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (
        h.hidden_size,
        h.intermediate_size,
        h.num_hidden_layers,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        h.num_attention_heads,
        h.num_key_value_heads,
        h.head_dim,
    )
    assert c.rms_norm_eps == h.rms_norm_eps and c.rope_theta == h.rope_parameters["rope_theta"]
    assert (
        c.max_position_embeddings == h.max_position_embeddings
        and c.tie_word_embeddings == h.tie_word_embeddings
    )
    assert c.bos_token_id == h.bos_token_id and c.eos_token_ids == (h.eos_token_id,)
    theirs = hf.state_dict()
    assert set(theirs) - set(ckpt.weights) == {"lm_head.weight"}  # tied: theirs is the embedding itself
    assert set(ckpt.weights) <= set(theirs)
    for name, w in ckpt.weights.items():
        assert torch.equal(w, theirs[name]), name  # incl. the q/k un-permutation, bit for bit


@pytest.mark.slow
def test_smollm2_logits_match_transformers_prefill_and_decode(smollm2):
    ckpt, hf = smollm2
    config = ckpt.config
    model = build_model(ckpt, torch.float32, "cpu")
    ids = ckpt.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    with torch.no_grad():
        for _ in range(4):  # greedy continuation by transformers, to decode through realistic tokens
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        ref = hf(torch.tensor([ids])).logits[0]
    n_prompt = len(ids) - 4

    kv = PagedKVCache.allocate(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim, torch.float32)
    seqs = PagedSequences(16, 4, max_blocks_per_seq=8)
    batch = seqs.batch([(0, ids[:n_prompt])])
    batch.sample_rows = torch.arange(n_prompt)
    got = [model(batch, kv)]
    for t in ids[n_prompt:]:
        got.append(model(seqs.batch([(0, [t])]), kv))
    diff = (torch.cat(got) - ref).abs().max().item()
    # fp32 throughout; only summation order differs. Measured 5.3e-5 with |logits| up to 27 over 30
    # layers (about 2 ulp of the largest logit); 2e-4 leaves room for other BLAS builds.
    assert diff < 2e-4, diff
    assert torch.equal(torch.cat(got)[n_prompt - 1 :].argmax(-1), ref[n_prompt - 1 :].argmax(-1))
