"""The folder layout is the architecture: kernels/, frontend/ and tui/ install inside blink_appliance."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_declared():
    tool = _pyproject()["tool"]["setuptools"]
    declared = set(tool["packages"])
    mapping = tool["package-dir"]
    found = set()
    for top, dotted in ((Path(v), k) for k, v in mapping.items()):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([dotted, *rel.parts]) if rel.parts else dotted)
    assert found <= declared, f"packages missing from pyproject: {sorted(found - declared)}"


def test_no_bare_top_level_packages():
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert all(name.startswith("blink_appliance") for name in mapping)
    import blink_appliance.frontend
    import blink_appliance.kernels
    import blink_appliance.tui

    assert Path(blink_appliance.kernels.__file__).parent == ROOT / "kernels"
    assert Path(blink_appliance.frontend.__file__).parent == ROOT / "frontend"
    assert Path(blink_appliance.tui.__file__).parent == ROOT / "tui"
