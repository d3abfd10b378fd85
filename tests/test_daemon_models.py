"""The daemon of a profile with several models (issue 21): one engine process per model, started
and watched on its region, restarted alone when it crashes or stalls; the shutdown word goes to every
region; GPU loops sharing a device run under a private MPS daemon at their SM shares. Stand-in
children, real regions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from blink_appliance.daemon import ApplianceDaemon, preflight
from blink_appliance.profile import parse_profile
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import EngineState
from tests.ring_support import SMALL, shm_region
from tests.test_daemon_supervision import StandInEngine, _once_then_stop

MODEL = {"source": "dummy:tiny", "device": "cpu", "kv_budget_gib": 0.01}


def two_model_daemon(tmp_path: Path) -> ApplianceDaemon:
    profile = parse_profile({"models": [{"name": "a", **MODEL}, {"name": "b", **MODEL}]}, origin="test")
    return ApplianceDaemon(profile, tmp_path / "profile.toml")


def test_one_engine_process_per_model_each_told_its_model(tmp_path):
    daemon = two_model_daemon(tmp_path)
    assert [e.index for e in daemon.engines] == [0, 1]
    assert [e.child.name for e in daemon.engines] == ["engine of a", "engine of b"]
    for e, models in zip(daemon.engines, ("0", "1"), strict=True):
        argv = e.child.argv
        assert argv[:4] == [
            sys.executable,
            "-m",
            "blink_appliance.engine.process",
            str(tmp_path / "profile.toml"),
        ]
        assert argv[argv.index("--model") + 1] == models and "--parent-pid" in argv
    daemon._workdir.rmdir()


def _with_stand_ins(daemon: ApplianceDaemon, regions: list[RingRegion]) -> list[StandInEngine]:
    engines = [StandInEngine(regions[e.index]) for e in daemon.engines]
    for e, engine in zip(daemon.engines, engines, strict=True):
        engine.name = e.child.name
        e.child = engine  # type: ignore[assignment]
    return engines


def test_a_crashed_engine_is_marked_failed_on_its_region_and_restarted_alone(tmp_path):
    with shm_region(SMALL) as t0, shm_region(SMALL) as t1:
        regions = [RingRegion.attach(t0, SMALL), RingRegion.attach(t1, SMALL)]
        daemon = two_model_daemon(tmp_path)
        a, b = _with_stand_ins(daemon, regions)
        regions[1].store("shutdown", 1)  # a stale word on the second region must not stop its engine
        daemon._start_engines(regions)
        assert a.started_with == [(0, EngineState.ABSENT)]
        assert [shutdown for shutdown, _ in b.started_with] == [0]
        epoch_a = regions[0].load("engine_epoch")
        b.code = -9  # b's engine dies; a's serves on
        daemon._stop.wait = _once_then_stop(daemon)
        daemon._supervise(regions)
        assert b.started_with[-1] == (0, EngineState.FAILED) and len(b.started_with) == 2
        assert len(a.started_with) == 1 and regions[0].load("engine_epoch") == epoch_a
        assert [r.load("engine_state") for r in regions] == [EngineState.RUNNING] * 2
        daemon._workdir.rmdir()


def test_a_stalled_heartbeat_on_one_region_kills_only_that_engine(tmp_path):
    with shm_region(SMALL) as t0, shm_region(SMALL) as t1:
        regions = [RingRegion.attach(t0, SMALL), RingRegion.attach(t1, SMALL)]
        daemon = two_model_daemon(tmp_path)
        a, b = _with_stand_ins(daemon, regions)
        daemon.engines[1].watch.limit_s = 0.3  # the stand-ins never beat: only b's watch can fire
        daemon._start_engines(regions)
        daemon._stop.wait = _once_then_stop(daemon, rounds=12, pause_s=0.05)
        daemon._supervise(regions)
        assert a.kills == 0 and b.kills >= 1
        assert b.started_with[1] == (0, EngineState.FAILED)
        daemon._workdir.rmdir()


def test_shutdown_writes_every_regions_shutdown_word(tmp_path):
    with shm_region(SMALL) as t0, shm_region(SMALL) as t1:
        regions = [RingRegion.attach(t0, SMALL), RingRegion.attach(t1, SMALL)]
        daemon = two_model_daemon(tmp_path)
        _with_stand_ins(daemon, regions)
        for e in daemon.engines:
            e.child.stop = lambda timeout_s: 0  # type: ignore[method-assign]
        assert daemon._shutdown(regions) == 0
        assert [r.load("shutdown") for r in regions] == [1, 1]
        daemon._workdir.rmdir()


def test_preflight_names_the_model_whose_files_are_missing(tmp_path):
    from blink_appliance.daemon import StartupError

    profile = parse_profile(
        {
            "models": [
                {"name": "a", **MODEL},
                {"name": "b", **MODEL, "source": f"gguf:{tmp_path / 'missing.gguf'}"},
            ],
            "frontend": {"port": 0},
        }
    )
    with pytest.raises(StartupError, match=r"^models\[1\].source: "):
        preflight(profile)


def test_gpu_loops_sharing_a_device_start_under_mps_at_their_shares(tmp_path, monkeypatch):
    """Two loop models on cuda:0: the device's free memory is read once and handed to both, MPS
    starts before them, each engine's environment carries its share, and MPS quits after them."""
    from blink_appliance import gpu_sharing
    from tests.test_gpu_sharing import _fake_control

    (bins := tmp_path / "bin").mkdir()
    _fake_control(bins, log := tmp_path / "mps.log")
    monkeypatch.setenv("PATH", f"{bins}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(gpu_sharing, "device_sm_count", lambda device: 132)
    monkeypatch.setattr(gpu_sharing, "device_free_bytes", lambda device: 70 << 30)
    gpu = {"source": "dummy:tiny", "device": "cuda:0", "kv_fraction": 0.4}
    profile = parse_profile(
        {"models": [{"name": "a", **gpu, "sm_count": 32}, {"name": "b", **gpu}, {"name": "c", **MODEL}]},
        origin="test",
    )
    daemon = ApplianceDaemon(profile, tmp_path / "profile.toml")
    daemon._share_gpus()
    a, b, c = (e.child for e in daemon.engines)
    for child in (a, b):
        assert child.argv[child.argv.index("--device-free-bytes") + 1] == str(70 << 30)
    assert "--device-free-bytes" not in c.argv and not c.env  # the CPU model is not an MPS client
    assert (a.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], b.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == (
        "25",
        "75",
    )
    assert a.env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon._workdir / "mps-pipe")
    assert daemon._shutdown([]) == 0  # no child ran: each stop is a no-op, then MPS quits
    assert log.read_text().splitlines()[-1] == "quit"
    daemon._workdir.rmdir()  # MPS left nothing behind in it
