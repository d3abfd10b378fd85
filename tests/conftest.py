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
