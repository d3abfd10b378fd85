"""bench interference: the workers really load the CPU, stop by themselves, on stop(), and when
their parent dies. Short runs (about 1.5 s)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from blink_appliance.bench.interference import Interference, InterferenceSpec, summarize


def _busy_cores(procs: list[psutil.Process], window_s: float = 0.4) -> list[float]:
    before = [p.cpu_times() for p in procs]
    time.sleep(window_s)
    after = [p.cpu_times() for p in procs]
    return [(b.user + b.system - a.user - a.system) / window_s for a, b in zip(before, after, strict=True)]


def test_spec_parse_and_refusals():
    spec = InterferenceSpec.parse("spin=2, memory=1,syscall=3,memory_mib=8", duration_s=5, cpus=(0, 1))
    assert (spec.spin, spec.memory, spec.syscall, spec.memory_mib, spec.cpus) == (2, 1, 3, 8, (0, 1))
    assert spec.describe() == "2 spin, 1 memory (8 MiB x2), 3 syscall pairs on cpus 0,1 for 5 s"
    for text, fragment in [
        ("spin=x", "integer"),
        ("fork=2", "expected spin=N"),
        ("spin", "expected spin=N"),
        ("", "at least one worker"),
        ("spin=-1", ">= 0"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            InterferenceSpec.parse(text, duration_s=1)
    with pytest.raises(ValueError, match="duration"):
        InterferenceSpec(duration_s=0, spin=1)


def test_workers_load_the_cpu_and_stop_by_themselves():
    duration = 1.5
    spec = InterferenceSpec(duration_s=duration, spin=1, memory=1, syscall=1, memory_mib=8)
    load = Interference(spec)
    load.start()  # returns once every worker is ready and has its deadline
    t0 = time.monotonic()
    try:
        assert len(load.pids) == 4  # spin, memory, ping, pong
        procs = [psutil.Process(pid) for pid in load.pids]
        busy = _busy_cores(procs, 0.6)
        # Every worker is running, not sleeping (a sleeping process uses ~0). Together they want
        # about 3.5 cores; even on a shared, busy 2-core runner they get a good part of that.
        assert all(b > 0.02 for b in busy), busy
        assert sum(busy) > 0.4, busy
        reports = load.wait(duration + 5)
        elapsed = time.monotonic() - t0
    finally:
        load.stop()
    assert not load.running
    assert duration - 0.1 < elapsed < duration + 1.0, elapsed  # ended at its deadline, nobody stopped it
    assert all(
        not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in load.pids
    )
    by_kind = {(r.kind, r.ops > 0) for r in reports}
    assert {("spin", True), ("memory", True), ("syscall", True)} <= by_kind
    memory = next(r for r in reports if r.kind == "memory")
    assert memory.ops % (2 * 8 * 2**20) == 0  # whole buffer copies
    lines = summarize(reports)
    assert [line.split(":")[0] for line in lines] == ["spin", "memory", "syscall ping-pong"]


def test_stop_ends_workers_early_and_collects_reports():
    load = Interference(InterferenceSpec(duration_s=60, spin=2))
    load.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    reports = load.stop()
    assert time.monotonic() - t0 < 2.5
    assert not load.running
    assert len(reports) == 2 and all(r.kind == "spin" and r.ops > 0 for r in reports)


def test_pinning_to_a_cpu():
    cpu = min(psutil.Process().cpu_affinity())
    with Interference(InterferenceSpec(duration_s=1.0, spin=1, cpus=(cpu,))) as load:
        assert psutil.Process(load.pids[0]).cpu_affinity() == [cpu]


def test_workers_exit_when_their_parent_dies(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from blink_appliance.bench.interference import Interference, InterferenceSpec
        load = Interference(InterferenceSpec(duration_s=60, spin=1, syscall=1))
        load.start()
        print(" ".join(map(str, load.pids)), flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3
        workers = [psutil.Process(p) for p in pids]
        time.sleep(0.3)
        parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
        parent.wait()
        gone, alive = psutil.wait_procs(workers, timeout=3)
        assert not alive, f"workers outlived their parent: {alive}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in pids if "pids" in locals() else []:
            if psutil.pid_exists(p):
                psutil.Process(p).kill()


def test_cli_interfere_runs_for_its_duration(capsys):
    from blink_appliance.cli import main

    t0 = time.monotonic()
    assert main(["bench", "interfere", "--spin", "1", "--duration", "1"]) == 0
    elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert "interference: 1 spin for 1 s" in out and "spin: 1 process(es)" in out
    assert 0.9 < elapsed < 3.5
    with pytest.raises(SystemExit):
        main(["bench", "interfere", "--cpus", "x"])
    assert main(["bench", "interfere", "--duration", "1"]) == 2  # no workers: a clear error
    assert "at least one worker" in capsys.readouterr().err
