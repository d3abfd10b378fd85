"""Several GPU loops on one device (blink_appliance/gpu_sharing.py): when MPS runs, each model's
SM share, and the private MPS control daemon's command lines and environment."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from blink_appliance import gpu_sharing
from blink_appliance.gpu_sharing import MpsControl, MpsError, mps_needed, plan_shares, shared_devices, sms_for
from blink_appliance.profile import ProfileError, parse_profile

MODEL = {"source": "dummy:tiny", "kv_budget_gib": 0.01, "max_model_len": 256}


def _profile(*models: dict):
    return parse_profile({"models": [{"name": f"m{i}", **MODEL, **m} for i, m in enumerate(models)]})


def test_mps_runs_for_two_loops_on_one_device_or_any_sm_count():
    assert not mps_needed(_profile({}, {}))  # two CPU reference models
    assert not mps_needed(_profile({"device": "cuda:0"}, {"device": "cuda:1"}))  # a GPU each
    assert mps_needed(_profile({"device": "cuda:0"}, {"device": "cuda:0"}))
    assert mps_needed(_profile({"device": "cuda:0", "sm_count": 32}))
    assert shared_devices(_profile({"device": "cuda:0"}, {}, {"device": "cuda:0"})) == {"cuda:0"}


def test_shares_match_what_mps_gave_on_an_h100():
    # bench/mps_probe.sh on an H100 (132 SMs): 25% ran on 32 SMs, 75% on 98.
    assert (sms_for(25, 132), sms_for(75, 132), sms_for(100, 132)) == (32, 98, 132)
    p = _profile({"device": "cuda:0", "sm_count": 32}, {"device": "cuda:0", "sm_count": 100})
    a, b = plan_shares(p, lambda device: 132)
    assert (a.percentage, a.sms, b.percentage, b.sms) == (25, 32, 76, 100)
    assert a.describe() == "32 of 132 SMs (sm_count 32; MPS active thread percentage 25)"


def test_models_without_sm_count_share_the_rest_or_the_whole_gpu():
    p = _profile({"device": "cuda:0", "sm_count": 32}, {"device": "cuda:0"}, {"device": "cuda:0"})
    shares = plan_shares(p, lambda device: 132)
    assert [(s.percentage, s.sms, s.requested) for s in shares] == [
        (25, 32, 32),
        (75, 98, None),
        (75, 98, None),
    ]
    whole = plan_shares(_profile({"device": "cuda:0"}, {"device": "cuda:0"}), lambda device: 132)
    assert [s.percentage for s in whole] == [100, 100]


@pytest.mark.parametrize(
    "counts, message",
    [
        ((100, 40), "models[0].sm_count + models[1].sm_count: 140 SMs once rounded to whole TPCs"),
        ((140, None), "models[0].sm_count: 140, but cuda:0 has 132 SMs"),
        ((132, None), "models[0].sm_count: leave 0 of cuda:0's 132 SMs for models[1]"),
    ],
)
def test_shares_that_do_not_fit_name_the_keys(counts, message):
    models = [{"device": "cuda:0"} | ({"sm_count": c} if c else {}) for c in counts]
    with pytest.raises(ProfileError, match=re.escape(message)):
        plan_shares(_profile(*models), lambda device: 132)


def _fake_control(bin_dir: Path, log: Path, exit_code: int = 0) -> None:
    """An nvidia-cuda-mps-control that records its arguments, stdin and MPS environment."""
    script = bin_dir / gpu_sharing.CONTROL
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {log}\n'
        f'[ "$1" = "-d" ] || cat >> {log}\n'
        f"exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_private_control_daemon_starts_and_quits_with_its_own_directories(tmp_path, monkeypatch):
    (bins := tmp_path / "bin").mkdir()
    _fake_control(bins, log := tmp_path / "calls.log")
    monkeypatch.setenv("PATH", f"{bins}{os.pathsep}{os.environ['PATH']}")
    mps = MpsControl(tmp_path / "work")
    mps.start()
    share = plan_shares(_profile({"device": "cuda:0", "sm_count": 32}), lambda device: 132)[0]
    env = mps.client_env(share)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "work" / "mps-pipe")
    mps.stop()
    calls = log.read_text().splitlines()
    pipe, logs = tmp_path / "work" / "mps-pipe", tmp_path / "work" / "mps-log"
    assert calls == [f"args=-d pipe={pipe} log={logs}", f"args= pipe={pipe} log={logs}", "quit"]
    assert not pipe.exists() and not logs.exists()


def test_a_control_daemon_that_fails_or_is_missing_is_a_clear_error(tmp_path, monkeypatch):
    (bins := tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(bins))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control is not on PATH"):
        MpsControl(tmp_path / "w1").start()
    _fake_control(bins, tmp_path / "calls.log", exit_code=3)
    mps = MpsControl(tmp_path / "w2")
    with pytest.raises(MpsError, match="exited with 3"):
        mps.start()
    mps.stop()  # cleans its directories though it never ran
    assert not (tmp_path / "w2" / "mps-pipe").exists()
