"""Host CPU: per-core load, the appliance's own CPU use, and the scheduling-latency probe.

Rates are deltas between consecutive `sample()` calls (one sampler per process, called on a fixed
cadence by TelemetrySource), computed from raw psutil counters rather than psutil.cpu_percent(),
whose hidden module-level state any other caller in the process would disturb.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from blink_appliance.telemetry.sched_probe import SchedLatencyProbe
from blink_appliance.telemetry.snapshot import HostStats

PidSource = Callable[[], Iterable[int]]


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
    """Samples host CPU; `pids` names the appliance's processes (default: this process)."""

    def __init__(
        self,
        pids: Iterable[int] | PidSource | None = None,
        *,
        probe: SchedLatencyProbe | None = None,
    ) -> None:
        if pids is None:
            self._pids: PidSource = lambda: (os.getpid(),)
        elif callable(pids):
            self._pids = pids
        else:
            fixed = tuple(pids)
            self._pids = lambda: fixed
        self.probe = probe if probe is not None else SchedLatencyProbe()
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

    def sample(self) -> HostStats:
        cores = psutil.cpu_times(percpu=True)
        per_core = [_busy_percent(a, b) for a, b in zip(self._last_cores, cores, strict=False)]
        self._last_cores = cores
        total = sum(per_core) / len(per_core) if per_core else 0.0

        pids = sorted(set(self._pids()))
        now = time.monotonic()
        cpu_seconds = 0.0
        percent = 0.0
        seen_any = False
        have_rate = False
        for pid in pids:
            proc = self._process(pid)
            if proc is None:
                continue
            try:
                t = proc.cpu_times()
            except psutil.Error:  # exited since the last sample
                self._procs.pop(pid, None)
                self._last_proc.pop(pid, None)
                continue
            used = t.user + t.system
            cpu_seconds += used
            seen_any = True
            prev = self._last_proc.get(pid)
            if prev is not None and now > prev[0]:
                percent += (used - prev[1]) / (now - prev[0]) * 100.0
                have_rate = True
            self._last_proc[pid] = (now, used)
        for gone in set(self._last_proc) - set(pids):
            self._last_proc.pop(gone, None)
            self._procs.pop(gone, None)

        ncores = len(per_core) or (psutil.cpu_count() or 1)
        p50, p99, worst, n = self.probe.stats() if self.probe.running else (None, None, None, 0)
        return HostStats(
            cpu_percent_per_core=per_core,
            cpu_percent_total=total,
            appliance_pids=pids,
            appliance_cpu_percent=percent if have_rate else None,
            appliance_share_percent=percent / ncores if have_rate else None,
            appliance_cpu_seconds=cpu_seconds if seen_any else None,
            sched_p50_us=p50,
            sched_p99_us=p99,
            sched_max_us=worst,
            sched_samples=n,
        )
