"""What a thread that wakes every millisecond costs the front end's event-loop thread (issue 22).

    python3 bench/gil_handoff.py [--seconds 5] [--out FILE]

The front end's ring pump runs ~20 numpy operations over every slot each pass (wire/channel_pump.py);
numpy lets go of the GIL for arrays over 500 elements, and a waiting thread can take it then. This
times such a pass (40 numpy operations over --slots elements) on this host alone, then beside a thread sleeping 1 ms in a loop (what
telemetry/sched_probe.py's probe does) and 10 ms, and beside the probe itself: pass time P50 / P99 /
max, in microseconds. A host whose threads wake slowly shows it in the tail.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def passes(seconds: float, slots: int) -> list[float]:
    a = np.arange(slots, dtype=np.uint64)
    b = np.ones(slots, dtype=np.uint64)
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(10):
            c = (a != b) & (b <= a)
            np.nonzero(c)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def sleeper(interval_s: float, stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(interval_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sys.setswitchinterval(0.001)  # as the front end sets it
    rows = {}
    for name in ("alone", "sleeper 1 ms", "sleeper 10 ms", "SchedLatencyProbe"):
        stop = threading.Event()
        probe = None
        if name.startswith("sleeper"):
            interval = float(name.split()[1]) / 1e3
            threading.Thread(target=sleeper, args=(interval, stop), daemon=True).start()
        elif name == "SchedLatencyProbe":
            from blink_appliance.telemetry.sched_probe import SchedLatencyProbe

            probe = SchedLatencyProbe()
            probe.start()
        times = np.array(passes(args.seconds, args.slots))
        stop.set()
        if probe is not None:
            probe.stop()
        time.sleep(0.05)
        rows[name] = {
            "passes": len(times), "p50_us": round(float(np.percentile(times, 50)), 1),
            "p99_us": round(float(np.percentile(times, 99)), 1), "max_us": round(float(times.max()), 1),
            "over_1ms": int((times > 1000).sum()),
        }  # fmt: skip
        print(f"{name:>18}: {rows[name]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
