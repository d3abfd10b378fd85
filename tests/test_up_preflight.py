"""`blink-appliance up` fails fast (issue 19): a taken port or a missing model file is one line on
stderr, exit 1, before the rings exist or the engine starts."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from blink_appliance import daemon
from blink_appliance.cli import main


@pytest.fixture
def no_engine(monkeypatch):
    """Starting any child process (the engine first) fails the test."""

    def refuse(self):
        raise AssertionError(f"{self.name} was started")

    monkeypatch.setattr(daemon._Child, "start", refuse)
    monkeypatch.setattr(daemon.ApplianceDaemon, "run", lambda self: pytest.fail("the daemon ran"))


def _profile(tmp_path: Path, source: str, port: int) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [appliance]
            shm_name = "blink-test-preflight"
            [[models]]
            name = "t"
            source = "{source}"
            kv_budget_gib = 0.001
            max_model_len = 256
            [frontend]
            port = {port}
            """
        )
    )
    return path


def test_up_on_a_taken_port_is_one_line_and_starts_nothing(tmp_path, capsys, no_engine):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _profile(tmp_path, "dummy:tiny", port)
        assert main(["up", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"frontend.port: cannot listen on 127.0.0.1:{port} (Address already in use)" in err
        assert main(["up", str(path), "--port", str(port)]) == 1
        assert "--port: cannot listen on" in capsys.readouterr().err


def test_up_on_a_free_port_goes_on_to_start(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(daemon.ApplianceDaemon, "run", lambda self: started.append(self.profile) or 0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["up", str(_profile(tmp_path, "dummy:tiny", port))]) == 0
    assert len(started) == 1


def test_up_with_a_missing_model_file_is_one_line_and_starts_nothing(tmp_path, capsys, no_engine):
    path = _profile(tmp_path, f"hf:{tmp_path / 'nowhere'}", 0)
    assert main(["up", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "models[0].source: hf: model directory not found" in err


def test_a_port_taken_while_the_engine_loads_is_one_line_from_the_front_end(tmp_path):
    """up's check passed, then another program took the port: the front end says so in one line and
    exits 2, with no traceback and no BufferError from the shared region."""
    import subprocess
    import sys

    from blink_appliance.profile import load_profile, ring_geometry
    from blink_appliance.wire.region import RingRegion
    from blink_appliance.wire.ring_layout import region_size
    from blink_appliance.wire.shm_transport import ShmTransport

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        path = _profile(tmp_path, "dummy:tiny", taken.getsockname()[1])
        profile = load_profile(path)
        geometry = ring_geometry(profile)
        transport = ShmTransport.create(profile.appliance.shm_name, region_size(geometry))
        try:
            RingRegion.create(transport, geometry)
            done = subprocess.run(
                [sys.executable, "-m", "blink_appliance.frontend", str(path)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            transport.close()
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("[frontend] frontend.port: cannot listen on 127.0.0.1:"), done.stderr
    assert "Traceback" not in done.stderr and "BufferError" not in done.stderr, done.stderr
