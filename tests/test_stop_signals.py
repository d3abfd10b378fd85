"""Stop signals set an Event without a lock in the signal handler (blink_appliance/processes.py).

Each case runs in a child process: a signal wakeup fd and signal handlers are process-wide."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# The main thread holds the event's internal lock (as it does for a moment inside Event.wait) when
# SIGTERM arrives. A handler that calls Event.set() waits for that lock in the thread that holds
# it: `blink-appliance up` hung so on SIGTERM (py-spy: nested handlers, each in Condition.__enter__).
# With mode "event-set-in-handler" (the old daemon's handler) this child hangs: checked 2026-11-24.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from blink_appliance.processes import set_on_signals
    stop = threading.Event()
    if sys.argv[1] == "event-set-in-handler":
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    else:
        set_on_signals(stop, [signal.SIGTERM, signal.SIGINT])
    with stop._cond:  # CPython's Event keeps its lock here
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    print("stopped" if stop.wait(5) else "not stopped", flush=True)
    stop.clear()
    os.kill(os.getpid(), signal.SIGINT)  # SIGINT too, and the process survives both
    print("stopped" if stop.wait(5) else "not stopped", flush=True)
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=20)


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_sets_it():
    done = _run("set_on_signals")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stopped", "stopped"]


def test_a_second_wakeup_fd_is_refused():
    code = (
        "import signal, threading\n"
        "from blink_appliance.processes import set_on_signals\n"
        "set_on_signals(threading.Event(), [signal.SIGTERM])\n"
        "set_on_signals(threading.Event(), [signal.SIGTERM])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert done.returncode == 1 and "already has a signal wakeup fd" in done.stderr


def test_a_signal_to_the_daemons_process_group_does_not_reach_its_children(tmp_path):
    """The daemon's children run in sessions of their own: a group SIGTERM (Ctrl-C's SIGINT,
    `timeout`) reaches the daemon alone, which drains the front end before it stops the engine."""
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(
        f"""
        import signal, sys, time
        from blink_appliance.daemon import _Child
        child = _Child("engine", [sys.executable, "-c", "import time; time.sleep(60)"])
        child.start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stands in for the daemon's drain
        time.sleep(60)
        """
    )
    daemon = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    child_pid = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and daemon.poll() is None, "the stand-in daemon did not start"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        os.killpg(daemon.pid, signal.SIGTERM)  # the whole group the daemon leads
        assert daemon.wait(10) == 0
        time.sleep(0.2)
        os.kill(child_pid, 0)  # the child is still there: the signal did not reach it
    finally:
        if daemon.poll() is None:
            daemon.kill()
        if child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


def test_up_stopped_while_its_front_end_starts_never_says_ready_and_exits_zero(tmp_path):
    from tests.live_appliance import write_profile

    profile = write_profile(tmp_path, "dummy:tiny")
    exe = Path(sys.executable).parent / "blink-appliance"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [str(exe), "up", str(profile)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: list[str] = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "frontend started" in line:
                proc.send_signal(signal.SIGTERM)  # the front end is importing, not yet listening
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + err
    assert proc.returncode == 0, log
    assert out == "", out  # stdout carries the URL once ready; it never was
    # (The front end may exit 0 or by the signal: it can arrive before its interpreter has a handler.)
    assert "ready:" not in log and "engine exit 0" in log, log


def test_an_engine_whose_daemon_is_gone_before_it_serves_exits_at_once(tmp_path):
    """A daemon killed while its engine builds (minutes on a GPU) left the engine holding the GPU
    until the build ended. Before it serves the engine has accepted nothing: it exits at once."""
    from blink_appliance.profile import load_profile, ring_geometry
    from blink_appliance.wire.region import RingRegion
    from blink_appliance.wire.ring_layout import region_size
    from blink_appliance.wire.shm_transport import ShmTransport
    from tests.ring_support import unique_name

    name = unique_name()
    profile = tmp_path / "p.toml"
    profile.write_text(
        f'[appliance]\nshm_name = "{name}"\n\n[[models]]\nname = "m"\nsource = "dummy:tiny"\n'
        'device = "cpu"\nkv_budget_gib = 0.01\n'
    )
    geometry = ring_geometry(load_profile(profile))
    transport = ShmTransport.create(name, region_size(geometry))
    try:
        RingRegion.create(transport, geometry)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])  # a "daemon" that is not our parent
        gone.wait()
        done = subprocess.run(
            [sys.executable, "-m", "blink_appliance.engine.process", str(profile), "--parent-pid", str(gone.pid)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        transport.close()
    assert done.returncode == 1, done.stderr
    assert "is gone while the engine starts; exiting" in done.stderr
    assert "serving on the rings" not in done.stderr
