"""Host and GPU samplers against the real machine: psutil counters, the sched probe, NVML; and a
stand-in NVML for a sample over several GPUs."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
from blink_appliance.frontend.__main__ import gpu_indices

from blink_appliance.bench.commands import _gpu_list
from blink_appliance.profile import parse_profile
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


class FakeNvml(types.ModuleType):
    """pynvml with GPUs of fixed readings (the real one needs a GPU); index 3 supports no energy."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM = 1

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__("pynvml")
        self.names = names

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i not in self.names:
            raise self.NVMLError(f"no device {i}")
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.names[h]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 100_000 * (h + 1)  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        if h == 3:
            raise self.NVMLError("not supported")
        return 1_000_000 * (h + 1)  # mJ

    def nvmlDeviceGetUtilizationRates(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=10 * (h + 1), memory=5)

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return 1000 + 100 * h

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=2**30 * (h + 1), total=2**30 * 80)


def test_gpu_sampler_over_several_gpus_sums_power_energy_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor-parallel engine's two GPUs: J/token must count both boards."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml({0: "H", 1: "H", 3: "X"}))
    one, two = GpuSampler(1), GpuSampler([0, 1, 0])  # a GPU listed twice counts once
    one.start()
    two.start()
    a, b = one.sample(), two.sample()
    assert (a.name, a.power_w, a.energy_j, a.gpu_util_percent) == ("H", 200.0, 2000.0, 20.0)
    assert (b.name, b.power_w, b.power_limit_w, b.energy_j) == ("2 x H", 300.0, 1400.0, 3000.0)
    assert (b.gpu_util_percent, b.sm_clock_mhz, b.memory_used_mib, b.memory_total_mib) == (
        15.0,
        1050.0,
        3072.0,
        163840.0,
    )
    assert two.device_names == {0: "H", 1: "H"}
    mixed = GpuSampler([0, 3])
    mixed.start()
    c = mixed.sample()
    assert c.name == "H + X" and c.energy_j is None and c.power_w == 500.0  # no sum of part of the boards
    missing = GpuSampler([0, 2])
    missing.start()
    assert not missing.available and missing.reason is not None and "no GPU 2" in missing.reason


def test_the_front_end_samples_every_gpu_a_models_engine_runs_on() -> None:
    def models(*sections: dict) -> list:
        return parse_profile({"models": list(sections)}, origin="test").models

    cpu = {"name": "c", "source": "dummy:tiny", "device": "cpu", "kv_budget_gib": 0.01}
    assert gpu_indices(models(cpu)) == [0]
    tp = {
        "name": "t",
        "source": "dummy:tiny",
        "device": "cuda:2",
        "tensor_parallel": 2,
        "kv_budget_gib": 0.01,
    }
    assert gpu_indices(models(tp)) == [2, 3]
    replicas = {"name": "r", "source": "dummy:tiny", "device": "cuda:0", "replicas": 2, "kv_budget_gib": 0.01}
    assert gpu_indices(models(replicas, cpu)) == [0, 1]


def test_bench_serve_takes_several_gpu_indices() -> None:
    assert _gpu_list("0") == (0,) and _gpu_list("0,1") == (0, 1) and _gpu_list("0-1,1") == (0, 1)
    for bad in ("", "a", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NVML GPU indices"):
            _gpu_list(bad)
