"""scripts/bootstrap.sh: `make up` installs only what serving needs, and pip runs only when
pyproject.toml (or the wanted extra) changed since the last successful install."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"

# Installed by the dev extra only: the serving path must run where none of them is present.
DEV_ONLY = ("triton", "transformers", "accelerate", "openai", "pytest", "hypothesis", "matplotlib", "ruff")

# A stand-in for .venv/bin/python: it logs each call and succeeds, so the script's decisions are
# visible without running pip.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
[ "$1" = --version ] && echo "Python 3.11.0"
exit 0
"""


def _serving_modules() -> list[str]:
    match = re.search(r"serving_modules=\((.*?)\)", SCRIPT.read_text(), re.S)
    assert match, "bootstrap.sh lists serving_modules"
    return match.group(1).split()


def test_serving_modules_exist():
    missing = [name for name in _serving_modules() if importlib.util.find_spec(name) is None]
    assert not missing, f"bootstrap.sh warms up modules that do not exist: {missing}"


def test_serving_path_imports_no_dev_only_package():
    # A finder ahead of all others refuses the dev-only packages, as a serving-only venv would.
    code = f"""
import importlib, sys
from importlib.abc import MetaPathFinder

class Refuse(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            raise ImportError(f"dev-only package {{name}} imported on the serving path")
        return None

sys.meta_path.insert(0, Refuse())
for name in {_serving_modules()!r}:
    importlib.import_module(name)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "bootstrap.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _bootstrap(tree: Path, extra: str) -> list[str]:
    """Run the script; return the pip installs it made (the fake python's logged calls)."""
    log = tree / ".venv" / "calls.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "BLINK_TORCH_VERSION")}
    result = subprocess.run(
        ["bash", str(tree / "scripts" / "bootstrap.sh"), extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if c.startswith("-m pip install")]


def test_serve_installs_only_the_runtime_dependencies(tree: Path):
    (install,) = _bootstrap(tree, "serve")
    assert install.endswith("torch==2.13.0 -e ."), install


def test_pip_is_skipped_until_pyproject_changes(tree: Path):
    assert _bootstrap(tree, "serve")
    assert _bootstrap(tree, "serve") == []
    with (tree / "pyproject.toml").open("a") as f:
        f.write("\n# a change\n")
    assert _bootstrap(tree, "serve")


def test_dev_after_serve_installs_the_dev_extra_and_serve_keeps_it(tree: Path):
    _bootstrap(tree, "serve")
    (install,) = _bootstrap(tree, "dev")
    assert install.endswith("-e .[dev]"), install
    assert _bootstrap(tree, "serve") == []  # `make up` after `make test`: nothing to do
    with (tree / "pyproject.toml").open("a") as f:
        f.write("\n# a change\n")
    (install,) = _bootstrap(tree, "serve")
    assert install.endswith("-e .[dev]"), "a reinstall keeps the test tools make test installed"
    assert _bootstrap(tree, "dev") == []


def test_unknown_extra_is_refused(tree: Path):
    result = subprocess.run(
        ["bash", str(tree / "scripts" / "bootstrap.sh"), "gpu"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "usage: scripts/bootstrap.sh [serve|dev]" in result.stderr
