"""Scheduling-latency probe: a thread that sleeps a fixed interval and records how late it wakes.

On an idle host a 1 ms sleep overshoots by tens of microseconds; when other work competes for
the cores (or for this process's GIL) the overshoot grows to milliseconds. That growth is what a
CPU-driven serving loop suffers once per token and what the GPU-resident loop is immune to, so the
dashboard shows it next to the token latencies.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from blink_appliance.telemetry.latency import percentile

_NS_PER_US = 1_000


class SchedLatencyProbe:
    def __init__(self, *, interval_s: float = 0.001, window_s: float = 1.0, max_samples: int = 4096) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._interval_ns = int(interval_s * 1e9)
        self._window_ns = int(window_s * 1e9)
        # (wake time ns, overshoot us); appended by the probe thread only.
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sched-latency-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic_ns()
            time.sleep(self.interval_s)
            after = time.monotonic_ns()
            overshoot_ns = max(0, after - before - self._interval_ns)
            self._samples.append((after, overshoot_ns / _NS_PER_US))

    def stats(self) -> tuple[float | None, float | None, float | None, int]:
        """(P50 us, P99 us, max us, sample count) of the wake-up overshoot over the last window."""
        since = time.monotonic_ns() - self._window_ns
        recent = sorted(v for t, v in list(self._samples) if t >= since)
        if not recent:
            return None, None, None, 0
        return percentile(recent, 50), percentile(recent, 99), recent[-1], len(recent)
