"""What every appliance process does to live beside the others: stop on signals, stop when its
parent is gone, and keep to the CPUs the profile gives it.

Stop signals (SIGTERM, SIGINT) become a `threading.Event` set from a thread of its own. Python runs
a signal handler in the main thread between two bytecodes, and that can be while the main thread
holds the event's internal lock (inside `Event.wait`) or is inside the handler already (a second
signal): `Event.set()` in the handler then waits for a lock its own thread holds, forever.
`blink-appliance up` hung so on SIGTERM. Here the handler does nothing; `signal.set_wakeup_fd` has
the interpreter write each signal's number into a pipe at C level, and a watcher thread reads it
and sets the event, where taking the lock is safe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: present so the signal's default action (exit) does not run; the
    wakeup fd carries the signal to the watcher."""


def set_on_signals(event: threading.Event, signals: Iterable[signal.Signals]) -> None:
    """From now on each of `signals` sets `event`. Call once, from the main thread, in a process
    that has no other wakeup fd (an asyncio loop installs its own: use add_signal_handler there)."""
    wanted = {int(s) for s in signals}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it; a full pipe drops the byte only
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        raise RuntimeError("this process already has a signal wakeup fd (an event loop's?)")
    for sig in wanted:
        signal.signal(sig, _noted)

    def watch() -> None:
        while True:
            if wanted.intersection(os.read(read_fd, 64)):
                event.set()

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()


FRONTEND_STOP_GRACE_S = 10.0  # past its drain, what a stopping front end gets to exit before it is killed
ENGINE_STOP_S = 15.0  # what an engine gets to stop on the shutdown word, after the front end


def shutdown_s(drain_timeout_s: float) -> float:
    """The longest an appliance's own shutdown takes: its front end drains and exits, then its
    engines stop (blink_appliance/daemon.py)."""
    return drain_timeout_s + FRONTEND_STOP_GRACE_S + ENGINE_STOP_S


def stop_child(proc: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """SIGTERM (a blink process drains on it), wait up to `timeout_s`, SIGKILL if it is still there:
    its exit code, and whether it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode, False
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s), False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), True


def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """From a daemon thread, call `on_gone` once this process's parent is no longer `parent_pid` (it
    was killed, so it cannot stop us, and the orphan was re-parented); checked every half second."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(0.5)
        on_gone()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def pin_cpus(cpus: list[int], key: str, error: type[Exception] = ValueError) -> None:
    """Pin this process to `cpus` (empty: leave it alone); a list the host cannot take raises `error`
    naming the profile `key`. If torch is loaded, its intra-op pool is sized to the pinned CPUs."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except (OSError, ValueError) as e:
        raise error(f"{key}: cannot pin to CPUs {cpus}: {e}") from None
    torch = sys.modules.get("torch")
    if torch is not None:
        # torch sized its pool from the CPUs the process had when torch was imported (all of them):
        # pinned to fewer, its threads would take turns on them and every parallel op waits for the last.
        torch.set_num_threads(len(set(cpus)))
