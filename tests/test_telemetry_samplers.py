"""Host and GPU samplers against the real machine: psutil counters, the sched probe, NVML."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
import pytest

from blink_appliance.telemetry.gpu import GpuSampler
from blink_appliance.telemetry.host import HostSampler
from blink_appliance.telemetry.sched_probe import SchedLatencyProbe


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_sched_probe_measures_wakeups() -> None:
    probe = SchedLatencyProbe(interval_s=0.001, window_s=1.0)
    probe.start()
    try:
        time.sleep(0.3)
        p50, p99, worst, n = probe.stats()
    finally:
        probe.stop()
    assert not probe.running
    # ~1.1 ms per iteration; a loaded CI box wakes less often but still many times.
    assert 50 <= n <= 300
    assert p50 is not None and p99 is not None and worst is not None
    assert 0 <= p50 <= p99 <= worst


def test_sched_probe_shows_interference() -> None:
    """A thread hogging this process's GIL delays the probe's wake-ups by ~the switch interval. The
    window (0.3 s) is shorter than the hog's run (0.4 s, timed by the hog itself), so it holds only
    wake-ups during the hog, however late a loaded host starts the hog's thread."""
    probe = SchedLatencyProbe(interval_s=0.001, window_s=0.3)
    probe.start()
    hog = threading.Thread(target=_spin, args=(0.4,))
    try:
        time.sleep(0.05)
        hog.start()
        hog.join()
        p50, p99, _, n = probe.stats()
    finally:
        probe.stop()
    assert n > 0
    assert p99 is not None and p99 > 1000  # µs: a 1 ms sleep woke more than 1 ms late
    assert sys.getswitchinterval() * 1e6 * 0.5 < p50


def test_host_sampler_per_core_and_own_cpu() -> None:
    sampler = HostSampler()  # this process
    sampler.start()
    try:
        sampler.sample()
        _spin(0.4)
        stats = sampler.sample()
    finally:
        sampler.stop()
    assert len(stats.cpu_percent_per_core) == psutil.cpu_count()
    assert all(0.0 <= c <= 100.0 for c in stats.cpu_percent_per_core)
    assert max(stats.cpu_percent_per_core) > 30.0  # the spinning core
    assert stats.appliance_pids == [psutil.Process().pid]
    assert [(p.role, p.pid) for p in stats.processes] == [("self", psutil.Process().pid)]
    # More than a fifth of a core: the spin's share on a loaded 2-core CI host, not a speed target.
    assert stats.appliance_cpu_percent is not None and stats.appliance_cpu_percent > 20.0
    assert stats.appliance_share_percent == pytest.approx(stats.appliance_cpu_percent / psutil.cpu_count())
    assert stats.appliance_cpu_seconds is not None and stats.appliance_cpu_seconds > 0.3
    assert stats.sched_samples > 0 and stats.sched_p99_us is not None


def test_host_sampler_follows_other_processes() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = HostSampler({"engine": busy.pid, "frontend": idle.pid})
        first = sampler.sample()
        assert first.appliance_cpu_percent is None  # no rate before a second reading
        time.sleep(0.5)
        stats = sampler.sample()
        assert stats.appliance_cpu_percent is not None and stats.appliance_cpu_percent > 20.0
        assert [p.role for p in stats.processes] == ["engine", "frontend"]
        assert stats.sched_p50_us is None  # probe not started: no reading, not a zero
        busy.kill()
        busy.wait()
        time.sleep(0.2)
        after = sampler.sample()
        assert after.appliance_cpu_percent is not None and after.appliance_cpu_percent < 20.0
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_gpu_sampler_without_nvml_reports_none(monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    sampler = GpuSampler()
    sampler.start()
    stats = sampler.sample()
    assert not sampler.available and not stats.available
    assert stats.reason is not None and "NVML" in stats.reason
    measured = stats.model_dump(exclude={"available", "reason"})
    assert measured and all(v is None for v in measured.values())


def test_gpu_sampler_without_package_reports_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    sampler = GpuSampler()
    sampler.start()
    stats = sampler.sample()
    assert stats.available is False and stats.reason == "nvidia-ml-py not installed"
    assert stats.power_w is None and stats.energy_j is None


def test_gpu_sampler_on_this_machine() -> None:
    """Whatever this machine has: real readings with a GPU, all None (with a reason) without."""
    sampler = GpuSampler()
    sampler.start()
    try:
        stats = sampler.sample()
    finally:
        sampler.stop()
    if stats.available:
        assert stats.name and stats.power_w is not None and stats.power_w > 0
    else:
        assert stats.reason and stats.power_w is None and stats.gpu_util_percent is None
