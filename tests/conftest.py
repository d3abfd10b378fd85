"""Shared pytest fixtures (each helper appends its own below)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF, pulled once into the model cache (kept across runs)."""
    from blink_appliance.model.loaders import model_registry

    return model_registry.resolve("smollm2-135m-instruct")
