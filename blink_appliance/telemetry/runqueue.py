"""Run-queue delay: how long a process's threads sat ready to run while no core was free.

Linux keeps, per thread, `/proc/<pid>/task/<tid>/schedstat`: time on a CPU, time waiting on a run
queue (both ns) and the number of timeslices. The waiting time is what other work on the cores costs
a thread directly, whatever it does with the time it gets; summed over the appliance's threads and
divided by the wall time between two readings it says how many milliseconds per second the
appliance's work was held back (1000 ms/s = on average one thread always waiting).

Per-thread deltas, not totals: threads come and go (a thread that exits takes its counters with it),
so only threads seen in both readings, and threads born in between, are counted.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def thread_wait_ns(pid: int, proc: Path = PROC) -> dict[int, int] | None:
    """tid -> run-queue wait (ns) for every thread of `pid`; None if the process is gone or the
    kernel has no schedstat (CONFIG_SCHED_INFO off, or not Linux)."""
    waits: dict[int, int] = {}
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return None
    for tid in tids:
        try:
            fields = (proc / str(pid) / "task" / tid / "schedstat").read_text().split()
        except OSError:  # the thread exited between listdir and read
            continue
        if len(fields) >= 2:
            waits[int(tid)] = int(fields[1])
    return waits or None


class RunQueueMeter:
    """Run-queue delay of a process's threads between consecutive `sample()` calls."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._last: dict[int, dict[int, int]] = {}  # pid -> tid -> wait ns at the previous reading

    def sample(self, pid: int) -> int | None:
        """ns the process's threads waited on a run queue since the last call for `pid` (None on
        the first call, or when it cannot be read)."""
        waits = thread_wait_ns(pid, self._proc)
        before = self._last.get(pid)
        if waits is None:
            self._last.pop(pid, None)
            return None
        self._last[pid] = waits
        if before is None:
            return None
        # A thread new since the last reading waited all of its counted time in between.
        return sum(max(0, w - before.get(tid, 0)) for tid, w in waits.items())

    def forget(self, keep: set[int]) -> None:
        """Drop the readings of processes no longer watched (an engine that was restarted)."""
        for pid in set(self._last) - keep:
            del self._last[pid]
