"""Model sources: dummy presets and the errors a user sees for bad sources."""

from __future__ import annotations

import json

import pytest
import torch

from blink_appliance.model.loaders import build_model, load_checkpoint
from blink_appliance.model.presets import PRESETS, preset_config, weight_shapes
from blink_appliance.model.sources import load_tokenizer


def test_dummy_is_deterministic_and_seeded():
    a = load_checkpoint("dummy:tiny", seed=3)
    b = load_checkpoint("dummy:tiny", seed=3)
    c = load_checkpoint("dummy:tiny", seed=4)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.weights[name], b.weights[name])
    assert not torch.equal(a.weights[name], c.weights[name])
    assert a.tokenizer is None and load_tokenizer("dummy:tiny") is None


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_dummy_presets_build(preset):
    model = build_model(load_checkpoint(f"dummy:{preset}"), torch.float32)
    assert set(dict(model.named_parameters())) == set(weight_shapes(preset_config(preset)))


def test_real_architecture_shapes():
    # Parameter counts of the real models these presets mirror.
    def count(name: str) -> float:
        return sum(torch.Size(s).numel() for s in weight_shapes(PRESETS[name]).values()) / 1e9

    assert count("llama-3.2-1b") == pytest.approx(1.236, abs=0.01)
    assert count("llama-3.1-8b") == pytest.approx(8.03, abs=0.01)
    assert count("smollm2-135m") == pytest.approx(0.1349, abs=0.001)


@pytest.mark.parametrize(
    ("source", "exc", "match"),
    [
        ("nonsense-model", ValueError, "unknown model source 'nonsense-model'"),
        ("dummy:llama-9000", ValueError, "unknown dummy preset 'llama-9000'"),
        ("dummy:", ValueError, "nothing after 'dummy:'"),
        ("hf:/no/such/dir", FileNotFoundError, "/no/such/dir"),
        ("gguf:/no/such/file.gguf", FileNotFoundError, "/no/such/file.gguf"),
    ],
)
def test_bad_sources_name_the_problem(source, exc, match):
    with pytest.raises(exc, match=match):
        load_checkpoint(source)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_checkpoint(f"hf:{tmp_path}")
    cfg = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        load_checkpoint(f"hf:{tmp_path}")
    cfg["rope_scaling"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(f"hf:{tmp_path}")
