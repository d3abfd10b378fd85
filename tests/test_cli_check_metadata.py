"""`blink-appliance check` reads metadata only (issue 19): headers and config.json, never the weights;
`--load` does the full load; a missing file is "invalid" naming the key; a named model that is not
cached is said, never downloaded; a CUDA profile on a machine without that device is checked for the
rest. Also `--version`."""

from __future__ import annotations

import json
import math
import struct
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from blink_appliance.cli import main
from blink_appliance.model import registry
from blink_appliance.model.loaders import dummy as dummy_loader
from blink_appliance.model.loaders import gguf_loader, hf
from blink_appliance.model.loaders.hf import config_from_hf
from blink_appliance.model.presets import weight_shapes
from tests.gguf_helpers import write_gguf

# A tiny Llama in HF form: enough for config_from_hf, and shapes the safetensors header must match.
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}


def _profile(tmp_path: Path, source: str, extra: str = "") -> Path:
    path = tmp_path / "p.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [[models]]
            name = "m"
            source = "{source}"
            kv_budget_gib = 0.01
            max_model_len = 256
            max_seqs = 4
            """
        )
        + textwrap.dedent(extra)
    )
    return path


@pytest.fixture
def no_weight_load(monkeypatch):
    """Every weight reader raises: a check that touches one fails loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("check read weights")

    monkeypatch.setattr(gguf_loader, "load_weights", refuse)
    monkeypatch.setattr(gguf_loader, "dequantize_tensor", refuse)
    monkeypatch.setattr(hf, "load_file", refuse)
    monkeypatch.setattr(hf, "load_hf_weights", refuse)
    monkeypatch.setattr(dummy_loader, "random_weights", refuse)
    monkeypatch.setattr(registry, "pull", refuse)


def _write_hf_dir(directory: Path, *, drop: str | None = None, tokenizer: bool = True) -> Path:
    """config.json, and a safetensors file whose data is a hole (sparse): only its header is real."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    header, offset = {}, 0
    for name, shape in weight_shapes(config_from_hf(HF_CONFIG)).items():
        if name == drop:
            continue
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.mark.parametrize(
    ("source", "error"),
    [("gguf:{}/missing.gguf", "GGUF file not found"), ("hf:{}/nowhere", "hf: model directory not found")],
)
def test_check_of_a_missing_model_is_invalid_and_names_the_key(
    tmp_path, capsys, no_weight_load, source, error
):
    path = _profile(tmp_path, source.format(tmp_path))
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert ": valid" not in captured.out
    assert f"invalid: models[0].source: {error}" in captured.err


def test_check_reads_a_gguf_header_without_loading_weights(tmp_path, capsys, no_weight_load):
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, layers=2)
    path = _profile(tmp_path, f"gguf:{gguf_file}")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "llama, 2 layers, hidden 256" in out and "tokenizer: GGUF metadata (gpt2)" in out
    assert "weights" in out and "blocks x 16 tokens" in out
    assert out.rstrip().endswith(f"profile {path}: valid")


def test_check_reads_safetensors_headers_without_loading_weights(tmp_path, capsys, no_weight_load):
    directory = _write_hf_dir(tmp_path / "hf")
    path = _profile(tmp_path, f"hf:{directory}")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "llama, 2 layers, hidden 64" in out and "tokenizer: tokenizer.json" in out
    assert out.rstrip().endswith("valid")


def test_check_finds_a_missing_tensor_and_a_missing_tokenizer(tmp_path, capsys, no_weight_load):
    directory = _write_hf_dir(tmp_path / "a", drop="model.layers.1.mlp.up_proj.weight")
    assert main(["check", str(_profile(tmp_path, f"hf:{directory}"))]) == 2
    err = capsys.readouterr().err
    assert "invalid: models[0].source" in err and "model.layers.1.mlp.up_proj.weight" in err
    directory = _write_hf_dir(tmp_path / "b", tokenizer=False)
    assert main(["check", str(_profile(tmp_path, f"hf:{directory}"))]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_check_refuses_a_truncated_safetensors_file(tmp_path, capsys, no_weight_load):
    directory = _write_hf_dir(tmp_path / "hf")
    shard = directory / "model.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    assert main(["check", str(_profile(tmp_path, f"hf:{directory}"))]) == 2
    assert "truncated" in capsys.readouterr().err


def test_check_does_not_pull_a_named_model(tmp_path, monkeypatch, capsys, no_weight_load):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "empty-cache"))
    path = tmp_path / "p.toml"
    path.write_text('[[models]]\nname = "smollm2-135m-instruct"\nkv_budget_gib = 0.01\nmax_model_len = 256\n')
    assert main(["check", str(path)]) == 0  # `up` would pull it: the profile itself is fine
    out = capsys.readouterr().out
    assert "is not in the local cache" in out and "blink-appliance models pull smollm2-135m-instruct" in out
    assert "not checked: the checkpoint and the memory plan" in out


def test_check_load_reads_every_weight(tmp_path, monkeypatch, capsys):
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, layers=1)
    loads = []
    real = gguf_loader.load_weights
    monkeypatch.setattr(gguf_loader, "load_weights", lambda *a, **k: loads.append(1) or real(*a, **k))
    path = _profile(tmp_path, f"gguf:{gguf_file}")
    assert main(["check", str(path)]) == 0
    assert loads == []
    assert main(["check", "--load", str(path)]) == 0
    assert loads == [1]
    out = capsys.readouterr().out
    assert "loaded 11 tensors in" in out and out.rstrip().endswith("valid")


def test_check_of_a_cuda_profile_without_the_device_checks_the_rest(tmp_path, capsys, no_weight_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    directory = _write_hf_dir(tmp_path / "hf")
    path = tmp_path / "p.toml"
    path.write_text(
        f'[[models]]\nname = "m"\nsource = "hf:{directory}"\ndevice = "cuda:0"\ndtype = "bfloat16"\n'
        'kv_fraction = 0.85\nmax_model_len = 256\nmax_seqs = 4\n[engine]\nmode = "loop"\n'
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kv_fraction=0.85 of cuda:0's free memory after the weights, sized when the engine starts" in out
    assert "engine loop: the GPU loop" in out
    assert "device cuda:0: this machine has 0 CUDA device(s)" in out
    assert "valid as far as this machine can tell; not checked: the device and the KV cache size" in out
    # What can be checked still is: a max_model_len beyond the model's context is invalid.
    path.write_text(path.read_text().replace("max_model_len = 256", "max_model_len = 4096"))
    assert main(["check", str(path)]) == 2
    assert "models[0].max_model_len" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"blink-appliance {version('blink-appliance')}"
