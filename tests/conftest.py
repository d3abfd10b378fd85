"""Shared pytest fixtures (each helper appends its own below)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF, pulled once into the model cache (kept across runs)."""
    from blink_appliance.model import registry

    return registry.resolve("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_source(request: pytest.FixtureRequest) -> str:
    """The cached SmolLM2 GGUF when the session fixture exists, else the named model (pulled once)."""
    try:
        return f"gguf:{request.getfixturevalue('smollm2_gguf_path')}"
    except pytest.FixtureLookupError:
        from tests.live_appliance import MODEL_NAME

        return MODEL_NAME


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, smollm2_source: str):
    """A live appliance (tests/live_appliance.py) serving the whole test module, stopped after it."""
    from tests.live_appliance import start_appliance

    pytest.importorskip("blink_appliance.engine.reference.engine", reason="the CPU engine has not landed")
    app = start_appliance(tmp_path_factory.mktemp("live"), smollm2_source)
    yield app
    code = app.stop()
    assert code == 0, f"appliance exited with {code}:\n{app.log()}"


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf_path: Path):
    """SmolLM2 as HF transformers loads the same GGUF, in fp32: the independent implementation the
    engine's numbers are checked against."""
    import torch

    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_models(smollm2_gguf_path: Path, smollm2_transformers):
    """(checkpoint, the reference engine's fp32 model, transformers' model) of SmolLM2."""
    import torch

    from blink_appliance.model.loaders import build_model, load_checkpoint

    ckpt = load_checkpoint(f"gguf:{smollm2_gguf_path}")
    return ckpt, build_model(ckpt, torch.float32, "cpu"), smollm2_transformers


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Triton's interpreter without its per-helper-call re-patching (tests/interpreter_speed.py), once a
    test module has imported it."""
    from tests.interpreter_speed import apply

    apply()
