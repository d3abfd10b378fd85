"""The systemd units: the settings the issue requires, and `systemd-analyze verify` where it exists."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNITS = sorted((REPO / "systemd").glob("*.service"))
INSTALL_PREFIX = "/opt/blink-appliance/.venv"


def _parse(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(path.read_text())
    return cp


def test_both_units_exist():
    assert {u.name for u in UNITS} == {"blink-appliance.service", "blink-frontend.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_required_settings(unit):
    service = _parse(unit)["Service"]
    assert service["Restart"] == "on-failure"
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["KillSignal"] == "SIGTERM"  # SIGTERM drains
    assert service["ExecStart"].startswith(INSTALL_PREFIX)
    assert "AllowedCPUs" in unit.read_text() and "cpus" in unit.read_text()  # pinning is documented


def test_appliance_unit_runs_up_on_a_profile():
    service = _parse(REPO / "systemd" / "blink-appliance.service")["Service"]
    assert service["ExecStart"].endswith("blink-appliance up /etc/blink-appliance/profile.toml")
    assert "blink-appliance check" in service["ExecStartPre"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart binaries exist: point the install prefix at this venv.
    venv = Path(sys.executable).parent.parent
    if not (venv / "bin" / "blink-appliance").exists():
        pytest.skip(f"no blink-appliance script in {venv}/bin (package not installed in this interpreter)")
    paths = []
    for unit in UNITS:
        target = tmp_path / unit.name
        target.write_text(unit.read_text().replace(INSTALL_PREFIX, str(venv)))
        paths.append(str(target))
    result = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # verify only warns on unknown keys; a warning about our units is a failure here.
    ours = [line for line in result.stderr.splitlines() if str(tmp_path) in line]
    assert not ours, "\n".join(ours)
