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
    assert "prefix cache on, over prompt blocks of 16 tokens" in out


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
        "engine host: the GPU loop, 12 request slots, 4 sequences a step, forward buckets [1, 2, 4, 8, 32, 64] tokens"
        in out
    )
    assert "http://127.0.0.1:8000 over shm" in out


TWO_ON_ONE_GPU = """
    [[models]]
    name = "a"
    source = "dummy:tiny"
    device = "cuda:0"
    max_model_len = 256
    kv_budget_gib = 0.001
    sm_count = {a}

    [[models]]
    name = "b"
    source = "dummy:tiny"
    device = "cuda:0"
    max_model_len = 256
    kv_budget_gib = {kv_b}
    {b_sm}
    """


def _two_on_one_gpu(tmp_path: Path, *, a: int, b_sm: str = "", kv_b: float = 0.001) -> Path:
    return _profile(tmp_path, TWO_ON_ONE_GPU.format(a=a, b_sm=b_sm, kv_b=kv_b))


def _an_h100_here(monkeypatch, *, memory_bytes: int = 80 << 30) -> None:
    """check sees an H100 as cuda:0, 132 SMs: the per-device SM and memory checks run on any machine."""
    from blink_appliance import cli

    monkeypatch.setattr(cli, "_missing_device", lambda device: None)
    monkeypatch.setattr(cli, "_device_memory", lambda device: memory_bytes)
    monkeypatch.setattr(cli, "_device_sms", lambda device: 132)


def test_check_without_the_gpu_says_the_sm_shares_were_not_checked(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the partitions are checked")
    assert main(["check", str(_two_on_one_gpu(tmp_path, a=66))]) == 0
    out = capsys.readouterr().out
    assert "valid as far as this machine can tell" in out
    assert "the SM shares of cuda:0 (their sum against its SMs)" in out
    assert "rings /dev/shm/blink-appliance:" in out and "rings /dev/shm/blink-appliance-1:" in out
    assert "engine processes: 2, one per model" in out


def test_check_prints_each_models_sm_share_and_memory(tmp_path, capsys, monkeypatch):
    _an_h100_here(monkeypatch)
    assert main(["check", str(_two_on_one_gpu(tmp_path, a=66))]) == 0
    out = capsys.readouterr().out
    assert "device cuda:0: 132 SMs" in out
    assert "models[0] 'a': SMs 66 of 132 SMs (sm_count 66; MPS active thread percentage 50)" in out
    assert "models[1] 'b': SMs 66 of 132 SMs (shares the rest; MPS active thread percentage 50)" in out
    assert "each model's engine runs under MPS at its share" in out
    assert "weights" in out and "+ KV" in out and "CUDA graphs and workspaces come on top" in out
    assert out.rstrip().endswith("valid")


@pytest.mark.parametrize(
    "a, b_sm, expected",
    [
        # 100 -> 76% -> 100 SMs and 31 -> 24% -> 30: fits; 100 and 40 -> 31% -> 40: 140 of 132
        (100, "sm_count = 40", "models[0].sm_count + models[1].sm_count: 140 SMs once rounded to whole TPCs"),
        # all of it for models[0] leaves nothing for models[1]
        (132, "", "models[0].sm_count: leave 0 of cuda:0's 132 SMs for models[1]"),
        (140, "", "models[0].sm_count: 140, but cuda:0 has 132 SMs"),
    ],
)
def test_check_refuses_sm_shares_the_gpu_cannot_give(tmp_path, capsys, monkeypatch, a, b_sm, expected):
    _an_h100_here(monkeypatch)
    assert main(["check", str(_two_on_one_gpu(tmp_path, a=a, b_sm=b_sm))]) == 2
    assert expected in capsys.readouterr().err


def test_check_refuses_models_that_do_not_fit_the_gpus_memory(tmp_path, capsys, monkeypatch):
    _an_h100_here(monkeypatch, memory_bytes=4 << 20)  # two 0.5 MiB models with 1 + 4 MiB of KV
    assert main(["check", str(_two_on_one_gpu(tmp_path, a=8, kv_b=2.0))]) == 2
    err = capsys.readouterr().err
    assert "models[0].kv_budget_gib + models[1].kv_budget_gib: the weights and KV caches of cuda:0's" in err


def test_check_refuses_sm_count_outside_the_gpu_loop(tmp_path, capsys):
    path = _profile(
        tmp_path,
        """
        [[models]]
        name = "tiny"
        source = "dummy:tiny"
        device = "cuda:0"
        kv_budget_gib = 0.001
        sm_count = 66
        [engine]
        mode = "host"
        """,
    )
    assert main(["check", str(path)]) == 2
    assert "models[0].sm_count: SM partitions are for models the GPU loop serves" in capsys.readouterr().err


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


def test_fleet_refuses_a_bad_profile_or_replica_count_before_starting_ray(tmp_path, capsys):
    assert main(["fleet", str(tmp_path / "missing.toml")]) == 2
    assert "profile not found" in capsys.readouterr().err
    path = _profile(tmp_path, '[[models]]\nname = "t"\nsource = "dummy:tiny"\nkv_budget_gib = 0.001\n')
    assert main(["fleet", str(path), "--replicas", "0"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "blink-appliance"
    if not exe.exists():
        pytest.skip("package not installed into this interpreter's environment")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for command in ("up", "fleet", "check", "models", "top"):
        assert command in r.stdout


def test_top_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["top", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--api-key" in out and "url" in out
