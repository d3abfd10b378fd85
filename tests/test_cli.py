"""The `blink-appliance` command line: check, argument errors, refusals (no live appliance here)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from blink_appliance.cli import main

REPO = Path(__file__).resolve().parents[1]


def _profile(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(textwrap.dedent(body))
    return path


def test_check_prints_the_resolved_plan(tmp_path, capsys):
    path = _profile(
        tmp_path,
        """
        [[models]]
        name = "tiny"
        source = "dummy:tiny"
        kv_budget_gib = 0.001
        max_model_len = 256
        max_seqs = 4
        """,
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "weights" in out and "kv cache" in out and "blocks x 16 tokens" in out
    assert "max_seqs       4" in out and "token budget   512" in out
    assert "rings /dev/shm/blink-appliance" in out
    assert "engine reference: the CPU reference engine" in out


def test_check_prints_the_loop_geometry_of_a_loop_profile(tmp_path, capsys):
    path = _profile(
        tmp_path,
        """
        [[models]]
        name = "tiny"
        source = "dummy:tiny"
        device = "cuda:0"
        kv_budget_gib = 0.001
        max_model_len = 256
        max_seqs = 4
        max_num_batched_tokens = 64
        [engine]
        mode = "host"
        num_slots = 12
        """,
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "engine host: the GPU loop, 12 request slots, 4 sequences a step, forward buckets [8, 32, 64] tokens"
        in out
    )
    assert "http://127.0.0.1:8000 over shm" in out


def test_check_refuses_what_is_not_built(tmp_path, capsys):
    path = _profile(
        tmp_path,
        """
        [[models]]
        name = "tiny"
        source = "dummy:tiny"
        device = "cuda:0"
        kv_budget_gib = 0.001
        sm_count = 66
        """,
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models[0].sm_count: not built yet" in err


def test_check_reports_plan_errors_with_the_key(tmp_path, capsys):
    path = _profile(
        tmp_path,
        """
        [[models]]
        name = "tiny"
        source = "dummy:tiny"
        kv_budget_gib = 0.00001
        max_model_len = 1024
        """,
    )
    assert main(["check", str(path)]) == 2
    assert "models[0].kv_budget_gib" in capsys.readouterr().err


def test_unknown_source_and_missing_profile(tmp_path, capsys):
    path = _profile(tmp_path, '[[models]]\nname = "x"\nsource = "bogus:thing"\nkv_budget_gib = 1\n')
    assert main(["check", str(path)]) == 2
    assert "model source" in capsys.readouterr().err
    assert main(["up", str(tmp_path / "missing.toml")]) == 2
    assert "profile not found" in capsys.readouterr().err


def test_up_refuses_bad_overrides(tmp_path, capsys):
    path = _profile(
        tmp_path,
        '[[models]]\nname = "t"\nsource = "dummy:tiny"\nkv_budget_gib = 0.001\nmax_model_len = 256\n',
    )
    assert main(["up", str(path), "--port", "99999"]) == 2
    assert "frontend.port" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "blink-appliance"
    if not exe.exists():
        pytest.skip("package not installed into this interpreter's environment")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for command in ("up", "check", "models", "top"):
        assert command in r.stdout


def test_top_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["top", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--api-key" in out and "url" in out
