"""Host CPU: per-core load, the appliance's own CPU use per process, what others take, the
appliance's run-queue delay, the interference verdict, and the scheduling-latency probe.

Rates are deltas between consecutive `sample()` calls (one sampler per process, called on a fixed
cadence by TelemetrySource), computed from raw psutil counters rather than psutil.cpu_percent(),
whose hidden module-level state any other caller in the process would disturb.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from blink_appliance.telemetry.interference import interference_verdict
from blink_appliance.telemetry.runqueue import RunQueueMeter
from blink_appliance.telemetry.sched_probe import SchedLatencyProbe
from blink_appliance.telemetry.snapshot import HostStats, ProcessStats

# role ("daemon", "frontend", "engine") -> pid; None or 0 for one not running (an engine restarting).
Processes = Mapping[str, int | None]
ProcessSource = Callable[[], Processes]


def _idle_and_total(t: Any) -> tuple[float, float]:
    # iowait counts as idle, as in psutil's own cpu_percent.
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    # guest time is already included in user/nice on Linux.
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return idle, total


def _busy_percent(before: Any, after: Any) -> float:
    idle0, total0 = _idle_and_total(before)
    idle1, total1 = _idle_and_total(after)
    dt = total1 - total0
    if dt <= 0:
        return 0.0
    busy = (dt - (idle1 - idle0)) / dt * 100.0
    return min(100.0, max(0.0, busy))


class HostSampler:
    """Samples host CPU; `processes` names the appliance's processes by role (default: this one).

    Pass a callable to follow processes that change: the engine gets a new pid when the daemon
    restarts it, and the front end reads the current one from the ring header on every sample.
    """

    def __init__(
        self,
        processes: Processes | ProcessSource | None = None,
        *,
        probe: SchedLatencyProbe | None = None,
    ) -> None:
        if processes is None:
            own = {"self": os.getpid()}
            self._processes: ProcessSource = lambda: own
        elif callable(processes):
            self._processes = processes
        else:
            fixed = dict(processes)
            self._processes = lambda: fixed
        self.probe = probe if probe is not None else SchedLatencyProbe()
        self.runqueue = RunQueueMeter()
        self._last_cores = psutil.cpu_times(percpu=True)
        self._procs: dict[int, psutil.Process] = {}
        # pid -> (monotonic s, cpu seconds) at the previous sample
        self._last_proc: dict[int, tuple[float, float]] = {}

    def start(self) -> None:
        self.probe.start()

    def stop(self) -> None:
        self.probe.stop()

    def _process(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                return None
            self._procs[pid] = proc
        return proc

    def _measure(self, role: str, pid: int, now: float) -> ProcessStats | None:
        """One process's CPU rate and run-queue delay since the last sample; None if it is gone."""
        proc = self._process(pid)
        if proc is None:
            return None
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited since the last sample
            self._procs.pop(pid, None)
            self._last_proc.pop(pid, None)
            return None
        used = t.user + t.system
        prev = self._last_proc.get(pid)
        self._last_proc[pid] = (now, used)
        waited_ns = self.runqueue.sample(pid)
        if prev is None or now <= prev[0]:
            return ProcessStats(role=role, pid=pid, cpu_seconds=used)
        dt = now - prev[0]
        return ProcessStats(
            role=role,
            pid=pid,
            cpu_percent=max(0.0, used - prev[1]) / dt * 100.0,
            cpu_seconds=used,
            runqueue_ms_per_s=waited_ns / 1e6 / dt if waited_ns is not None else None,
        )

    def _measure_all(self) -> list[ProcessStats]:
        roles: dict[int, str] = {}
        for role, pid in self._processes().items():
            if pid and pid not in roles:  # one process under two roles is counted once
                roles[pid] = role
        now = time.monotonic()
        found = [s for pid, role in roles.items() if (s := self._measure(role, pid, now)) is not None]
        for gone in set(self._last_proc) - set(roles):
            self._last_proc.pop(gone, None)
            self._procs.pop(gone, None)
        self.runqueue.forget(set(roles))
        return found

    def sample(self) -> HostStats:
        cores = psutil.cpu_times(percpu=True)
        per_core = [_busy_percent(a, b) for a, b in zip(self._last_cores, cores, strict=False)]
        self._last_cores = cores
        total = sum(per_core) / len(per_core) if per_core else 0.0
        ncores = len(per_core) or (psutil.cpu_count() or 1)

        procs = self._measure_all()
        # A rate only once every process has one: a sum missing the engine would understate it.
        have_rate = bool(procs) and all(p.cpu_percent is not None for p in procs)
        percent = sum(p.cpu_percent or 0.0 for p in procs) if have_rate else None
        others = max(0.0, sum(per_core) - percent) if percent is not None else None
        others_share = others / ncores if others is not None else None
        waits = [p.runqueue_ms_per_s for p in procs]
        runqueue = sum(w for w in waits if w is not None) if have_rate and None not in waits else None

        p50, p99, worst, n = self.probe.stats() if self.probe.running else (None, None, None, 0)
        return HostStats(
            cpu_percent_per_core=per_core,
            cpu_percent_total=total,
            appliance_pids=sorted(p.pid for p in procs),
            processes=procs,
            appliance_cpu_percent=percent,
            appliance_share_percent=percent / ncores if percent is not None else None,
            appliance_cpu_seconds=sum(p.cpu_seconds or 0.0 for p in procs) if procs else None,
            others_cpu_percent=others,
            others_share_percent=others_share,
            runqueue_ms_per_s=runqueue,
            interference=interference_verdict(others_share, runqueue),
            sched_p50_us=p50,
            sched_p99_us=p99,
            sched_max_us=worst,
            sched_samples=n,
        )
