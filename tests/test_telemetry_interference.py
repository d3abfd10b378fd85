"""What others take: the host sampler counts every appliance process (the engine too), measures the
load outside them and the appliance's run-queue delay, and calls a busy loop on every core
"contended". Real processes on the real machine; waits end on the measured condition."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from blink_appliance.telemetry import HostSampler, HostStats, interference_verdict
from blink_appliance.telemetry.interference import (
    OTHERS_CONTENDED_PERCENT,
    RUNQUEUE_CONTENDED_MS_PER_S,
)
from blink_appliance.telemetry.runqueue import RunQueueMeter, thread_wait_ns

# A bounded busy loop: prints once it spins, stops by itself after 60 s even if never killed.
SPIN = "import time,sys\nend=time.monotonic()+60\nprint('spinning',flush=True)\nwhile time.monotonic()<end: pass\n"
IDLE = "import sys\nprint('ready',flush=True)\nsys.stdin.read()\n"


def _start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline()  # the event: it is running
    return proc


@pytest.fixture
def spawn() -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(code: str) -> subprocess.Popen[str]:
        procs.append(_start(code))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def sample_until(
    sampler: HostSampler, done: Callable[[HostStats], bool], timeout_s: float = 30.0
) -> HostStats:
    """Sample every 0.25 s (the rates need an interval) until `done` holds; fail after timeout_s."""
    sampler.sample()
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(0.25)
        stats = sampler.sample()
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"never reached: last sample {stats.model_dump()}"


@pytest.mark.parametrize(
    ("others", "runqueue", "verdict"),
    [
        (None, None, None),  # first sample: no rate yet
        (0.0, 0.0, "quiet"),
        (8.0, 900.0, "quiet"),  # nobody else on the cores: the wait is the appliance's own
        (15.0, 10.0, "quiet"),
        (25.0, 0.0, "busy"),
        (15.0, 60.0, "busy"),
        (15.0, 250.0, "contended"),
        (55.0, None, "contended"),  # no schedstat on this kernel: others' share alone
        (97.0, 0.0, "contended"),
    ],
)
def test_verdict_thresholds(others: float | None, runqueue: float | None, verdict: str | None) -> None:
    assert interference_verdict(others, runqueue) == verdict


def test_runqueue_meter_counts_new_threads_and_forgets_gone_processes(tmp_path) -> None:
    def write(pid: int, waits: dict[int, int]) -> None:
        for tid, wait in waits.items():
            task = tmp_path / str(pid) / "task" / str(tid)
            task.mkdir(parents=True, exist_ok=True)
            (task / "schedstat").write_text(f"123 {wait} 4\n")

    meter = RunQueueMeter(tmp_path)
    write(7, {7: 1000, 8: 500})
    assert meter.sample(7) is None  # first reading: a baseline
    write(7, {7: 4000, 9: 200})  # thread 8 exited, thread 9 was born
    assert meter.sample(7) == 3000 + 200
    assert meter.sample(99) is None  # no such process
    meter.forget(set())
    assert meter.sample(7) is None  # a baseline again


def test_busy_loop_on_every_core_reads_contended_and_the_engine_is_counted(spawn) -> None:
    """The appliance is this process (the front end) and a child (the engine); a busy loop per core
    is the others. The engine's CPU is in the sum, the others' share is measured, the verdict is
    contended."""
    if thread_wait_ns(os.getpid()) is None:
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat on this kernel")
    engine = spawn(SPIN)
    pids = {"frontend": os.getpid(), "engine": engine.pid}
    sampler = HostSampler(lambda: pids)
    for _ in range(psutil.cpu_count() or 1):
        spawn(SPIN)
    # Under the loops the engine gets only a share of a core (less on a loaded CI host): wait for it.
    stats = sample_until(
        sampler,
        lambda s: (
            s.interference == "contended"
            and (s.others_share_percent or 0) >= OTHERS_CONTENDED_PERCENT
            and any(p.role == "engine" and (p.cpu_percent or 0) > 5.0 for p in s.processes)
        ),
    )
    by_role = {p.role: p for p in stats.processes}
    assert set(by_role) == {"frontend", "engine"} and stats.appliance_pids == sorted(pids.values())
    assert by_role["engine"].pid == engine.pid and by_role["frontend"].cpu_percent is not None
    assert stats.appliance_cpu_percent == pytest.approx(sum(p.cpu_percent or 0 for p in stats.processes))
    ncores = len(stats.cpu_percent_per_core)
    assert stats.others_cpu_percent == pytest.approx(stats.others_share_percent * ncores)
    assert stats.others_cpu_percent == pytest.approx(
        max(0.0, sum(stats.cpu_percent_per_core) - stats.appliance_cpu_percent)
    )
    # The engine spins next to a loop per core: its thread waits for a core, and that is measured.
    stats = sample_until(sampler, lambda s: (s.runqueue_ms_per_s or 0) >= RUNQUEUE_CONTENDED_MS_PER_S)
    assert stats.processes[-1].runqueue_ms_per_s is not None


def test_the_engine_pid_is_followed_across_a_restart(spawn) -> None:
    """The front end reads the engine's pid from the ring on every sample; a restarted engine (a
    new pid) is counted, the old one dropped."""
    first = spawn(SPIN)
    current = {"frontend": os.getpid(), "engine": first.pid}
    sampler = HostSampler(lambda: current)
    stats = sample_until(sampler, lambda s: (s.appliance_cpu_percent or 0) > 50.0)
    assert {p.role: p.pid for p in stats.processes}["engine"] == first.pid

    second = spawn(IDLE)
    first.kill()
    first.wait()
    current["engine"] = second.pid
    stats = sample_until(
        sampler, lambda s: s.appliance_cpu_percent is not None and s.appliance_cpu_percent < 50.0
    )
    assert {p.role: p.pid for p in stats.processes}["engine"] == second.pid
    assert first.pid not in stats.appliance_pids

    current["engine"] = 0  # the engine is between restarts: no pid in the ring
    stats = sampler.sample()
    assert [p.role for p in stats.processes] == ["frontend"]
