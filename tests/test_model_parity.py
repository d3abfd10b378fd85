"""The reference model against Hugging Face transformers, same weights, fp32.

Each HF model is saved with save_pretrained and loaded back through our `hf:` loader, so this also
tests the HF config/weight mapping. Logits are compared for a prefill over the whole prompt (all
rows), then token-by-token decode through the paged cache with a sequence spanning many blocks, and
a mixed step where one sequence decodes while another prefills a chunk.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from tests.model_helpers import PagedSequences  # noqa: E402

TOL = 1e-4
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _llama():
    cfg = transformers.LlamaConfig(
        **COMMON,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(
        **COMMON,
        head_dim=32,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    torch.manual_seed(1234)
    hf = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}[request.param]()
    with torch.no_grad():  # random norms and biases too, so a mis-mapped one cannot hide
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    hf = hf.float().eval()
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    ckpt = load_checkpoint(f"hf:{d}")
    ours = build_model(ckpt, torch.float32, "cpu")
    return request.param, hf, ours, ckpt.config


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_mapping(pair):
    arch, hf, _, config = pair
    assert config.arch == arch
    assert config.num_kv_heads == 2 and config.num_layers == 3
    assert config.qk_norm == (arch == "qwen3")
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert (config.rope_scaling is not None) == (arch == "llama")


def test_prefill_all_rows_then_decode_many_blocks(pair):
    _, hf, ours, config = pair
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (45,), generator=g).tolist()
    ref = _hf_logits(hf, ids)

    block_size = 4
    kv = PagedKVCache.allocate(
        config.num_layers, 64, block_size, config.num_kv_heads, config.head_dim, torch.float32
    )
    seqs = PagedSequences(64, block_size, max_blocks_per_seq=16)
    prompt, rest = ids[:30], ids[30:]
    batch = seqs.batch([(0, prompt)])
    batch.sample_rows = torch.arange(len(prompt))  # every row, to check every position
    got = ours(batch, kv)
    assert (got - ref[:30]).abs().max().item() < TOL

    for i, t in enumerate(rest):  # decode token by token through the cache (12 blocks in the end)
        got = ours(seqs.batch([(0, [t])]), kv)[0]
        assert (got - ref[30 + i]).abs().max().item() < TOL, f"decode step {i}"
    assert len(seqs.tables[0]) == 12


def test_mixed_prefill_chunks_and_decode(pair):
    _, hf, ours, config = pair
    g = torch.Generator().manual_seed(11)
    a = torch.randint(0, config.vocab_size, (21,), generator=g).tolist()
    b = torch.randint(0, config.vocab_size, (17,), generator=g).tolist()
    c = torch.randint(0, config.vocab_size, (9,), generator=g).tolist()
    ref_a, ref_b, ref_c = _hf_logits(hf, a), _hf_logits(hf, b), _hf_logits(hf, c)

    kv = PagedKVCache.allocate(config.num_layers, 48, 4, config.num_kv_heads, config.head_dim, torch.float32)
    seqs = PagedSequences(48, 4, max_blocks_per_seq=8, seed=3)
    # Step 1: a prefills 20 tokens, b its first chunk of 10.
    out = ours(seqs.batch([(0, a[:20]), (1, b[:10])]), kv)
    assert (out[0] - ref_a[19]).abs().max() < TOL and (out[1] - ref_b[9]).abs().max() < TOL
    # Step 2: a decodes, b prefills its second chunk, c prefills whole; a decode-only single-token chunk too.
    out = ours(seqs.batch([(0, a[20:21]), (1, b[10:16]), (2, c)]), kv)
    assert (out[0] - ref_a[20]).abs().max() < TOL
    assert (out[1] - ref_b[15]).abs().max() < TOL
    assert (out[2] - ref_c[8]).abs().max() < TOL
    # Step 3: a one-token last prefill chunk for b next to nothing else.
    out = ours(seqs.batch([(1, b[16:17])]), kv)
    assert (out[0] - ref_b[16]).abs().max() < TOL


def test_load_weights_rejects_mismatch(pair):
    _, _, ours, config = pair
    weights = {k: v.clone() for k, v in ours.state_dict().items() if k != "inv_freq"}
    weights.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        ours.load_weights(weights)
