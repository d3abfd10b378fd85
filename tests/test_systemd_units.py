"""The systemd units and scripts/install.sh: settings, sandbox, `systemd-analyze` where it exists.

`systemd-analyze` is not part of CI's image: the tests that need it skip with a reason there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blink_appliance.model import registry

REPO = Path(__file__).resolve().parents[1]
UNITS = sorted((REPO / "systemd").glob("*.service"))
APPLIANCE = REPO / "systemd" / "blink-appliance.service"
FRONTEND = REPO / "systemd" / "blink-frontend.service"
INSTALL_PREFIX = "/opt/blink-appliance/.venv"
INSTALL_SH = REPO / "scripts" / "install.sh"
MAX_EXPOSURE = 4.0  # issue 19: "systemd-analyze security at 4.0 or better for each unit"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """section -> key -> every value in order (systemd keys repeat: Environment=, ExecStartPre=)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if section is None or not sep or not key.strip().isidentifier():
            raise ValueError(f"line {number}: not a 'Key=value' inside a section: {raw!r}")
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def service(path: Path) -> dict[str, list[str]]:
    return parse_unit(path.read_text())["Service"]


def last(settings: dict[str, list[str]], key: str) -> str | None:
    values = settings.get(key)
    return values[-1] if values else None


def truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "yes", "true", "on")


def test_both_units_exist():
    assert {u.name for u in UNITS} == {"blink-appliance.service", "blink-frontend.service"}


def test_parser_rejects_a_line_outside_a_section():
    with pytest.raises(ValueError, match="line 1"):
        parse_unit("User=blink\n[Service]\n")


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_required_settings(unit):
    s = service(unit)
    assert last(s, "Restart") == "on-failure"
    assert last(s, "LimitMEMLOCK") == "infinity"
    assert last(s, "KillSignal") == "SIGTERM"  # SIGTERM drains
    assert last(s, "User") == "blink"
    assert all(cmd.startswith(INSTALL_PREFIX) for cmd in s["ExecStart"])
    assert "AllowedCPUs" in unit.read_text() and "cpus" in unit.read_text()  # pinning is documented


def test_appliance_unit_runs_up_on_a_profile():
    s = service(APPLIANCE)
    assert s["ExecStart"] == [f"{INSTALL_PREFIX}/bin/blink-appliance up /etc/blink-appliance/profile.toml"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_exec_start_pre_loads_no_weights(unit):
    # Issue 19: a full weight load ran on every start. `check` without --load reads metadata only.
    for command in service(unit).get("ExecStartPre", []):
        argv = command.lstrip("-@:+!").split()
        assert "--load" not in argv, command
        if "check" in argv:
            assert argv[argv.index("check") :] == ["check", "/etc/blink-appliance/profile.toml"], command


def test_frontend_unit_runs_the_dpu_front_end_on_a_profile():
    # The DPU role (transport "nixl"): `blink-appliance frontend` on the same profile as the GPU host.
    s = service(FRONTEND)
    assert s["ExecStart"] == [
        f"{INSTALL_PREFIX}/bin/blink-appliance frontend /etc/blink-appliance/profile.toml"
    ]
    # `check` imports torch (checkpoint metadata, CUDA devices), which a DPU does not have.
    assert "ExecStartPre" not in s
    assert "NOT BUILT" not in FRONTEND.read_text()
    # The shared secret may come from the env file (BLINK_DPU_SECRET).
    assert any(v.lstrip("-") == "/etc/blink-appliance/env" for v in s["EnvironmentFile"])


def test_appliance_unit_checks_the_profile_before_start():
    assert service(APPLIANCE)["ExecStartPre"] == [
        f"{INSTALL_PREFIX}/bin/blink-appliance check /etc/blink-appliance/profile.toml"
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_model_cache_is_the_cache_directory(unit):
    # The named-model cache must be the directory systemd creates writable for the unit
    # (ProtectSystem=strict leaves nothing else under /var writable), named by the variable the
    # registry reads.
    s = service(unit)
    assert last(s, "ProtectSystem") == "strict"
    cache = last(s, "CacheDirectory")
    env = dict(item.split("=", 1) for value in s["Environment"] for item in value.split())
    assert env[registry.CACHE_ENV] == f"/var/cache/{cache}"


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_dev_shm_is_not_split(unit):
    # The rings are a file in /dev/shm shared by the daemon, the engine and the front end (and the
    # front-end unit when it runs apart): nothing may hide it, remount it or make it read-only.
    s = service(unit)
    for key in (
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "ReadOnlyPaths",
        "BindPaths",
        "BindReadOnlyPaths",
    ):
        for value in s.get(key, []):
            assert "/dev" not in value, f"{key}={value}"
    assert "/dev/shm" in unit.read_text()  # the unit says why its settings keep /dev/shm shared


def test_engine_unit_reaches_the_gpu_and_nothing_else():
    s = service(APPLIANCE)
    assert not truthy(last(s, "PrivateDevices"))  # a private /dev would hide /dev/nvidia*
    assert last(s, "DevicePolicy") == "closed"
    assert "char-nvidia* rw" in s["DeviceAllow"]
    # oneDNN's JIT (torch CPU kernels) needs memory that is written, then executed.
    assert not truthy(last(s, "MemoryDenyWriteExecute"))


def test_frontend_unit_has_no_devices():
    s = service(FRONTEND)
    assert truthy(last(s, "PrivateDevices"))
    assert "DeviceAllow" not in s


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_network_is_inet_unix_and_netlink_only(unit):
    # AF_NETLINK: UCX (NIXL's backend, transport "nixl") and the ring agent find network interfaces
    # with getifaddrs(), which uses a netlink socket; without it NIXL's UCX backend fails to start.
    families = set(" ".join(service(unit)["RestrictAddressFamilies"]).split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


def _analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed here (Debian: apt-get install systemd)")
    return exe


def test_systemd_analyze_verify(tmp_path):
    analyze = _analyze()
    # verify checks that ExecStart binaries exist: point the install prefix at this venv.
    venv = Path(sys.executable).parent.parent
    if not (venv / "bin" / "blink-appliance").exists():
        pytest.skip(f"no blink-appliance script in {venv}/bin (package not installed in this interpreter)")
    paths = []
    for unit in UNITS:
        target = tmp_path / unit.name
        target.write_text(unit.read_text().replace(INSTALL_PREFIX, str(venv)))
        paths.append(str(target))
    result = subprocess.run([analyze, "verify", *paths], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # verify only warns on unknown keys and bad values; a warning about our units is a failure here.
    ours = [line for line in result.stderr.splitlines() if str(tmp_path) in line]
    assert not ours, "\n".join(ours)


def exposure(analyze: str, unit: Path) -> float:
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    found = re.search(rf"Overall exposure level for {re.escape(unit.name)}: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_security_exposure_at_most_4(unit):
    score = exposure(_analyze(), unit)
    assert score <= MAX_EXPOSURE, f"{unit.name} rates {score} (docs/install.md records the scores)"


# -- scripts/install.sh ----------------------------------------------------------------------------


def run_install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL_SH), "--no-venv", *args], capture_output=True, text=True, timeout=120
    )


def test_install_script_parses():
    assert subprocess.run(["bash", "-n", str(INSTALL_SH)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        return  # CI has no shellcheck; bash -n above still ran
    result = subprocess.run(["shellcheck", str(INSTALL_SH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_install_stages_units_and_profile_idempotently(tmp_path):
    root = tmp_path / "root"
    first = run_install("--root", str(root))
    assert first.returncode == 0, first.stderr
    for unit in UNITS:
        assert (root / "etc/systemd/system" / unit.name).read_text() == unit.read_text()
    profile = root / "etc/blink-appliance/profile.toml"
    assert profile.read_text() == (REPO / "profiles/default.toml").read_text()
    assert oct(profile.stat().st_mode & 0o777) == "0o640"
    assert (root / "opt/blink-appliance/docs/install.md").is_file()
    assert (root / "var/cache/blink-appliance").is_dir()

    profile.write_text("# the operator's own\n")
    second = run_install("--root", str(root), "--profile", str(REPO / "profiles/gpu-h100.example.toml"))
    assert second.returncode == 0, second.stderr
    assert profile.read_text() == "# the operator's own\n"  # never overwritten
    assert "is current" in second.stdout
    assert not list((root / "etc/systemd/system").glob("*.bak"))


def test_install_rewrites_units_for_another_prefix_and_keeps_the_old_one(tmp_path):
    root = tmp_path / "root"
    assert run_install("--root", str(root)).returncode == 0
    moved = run_install("--root", str(root), "--prefix", "/srv/blink")
    assert moved.returncode == 0, moved.stderr
    unit = (root / "etc/systemd/system/blink-appliance.service").read_text()
    assert "/srv/blink/.venv/bin/blink-appliance up" in unit and "/opt/blink-appliance" not in unit
    backup = root / "etc/systemd/system/blink-appliance.service.bak"
    assert backup.read_text() == APPLIANCE.read_text()


def test_install_refuses_bad_arguments(tmp_path):
    result = run_install("--root", str(tmp_path), "--prefix", "relative/dir")
    assert result.returncode == 2 and "absolute" in result.stderr
    result = run_install("--root", str(tmp_path), "--profile", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "no profile" in result.stderr
