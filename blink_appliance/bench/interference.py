"""Bounded co-located CPU load: what a busy host does to a serving loop that needs the CPU.

Three kinds of worker, each its own process, started with `spawn` (a fresh interpreter: none of
the parent's threads or held locks come along):
- spin: a tight pure-Python loop that keeps one core busy;
- memory: copies a buffer larger than a last-level cache back and forth, evicting the caches and
  using memory bandwidth;
- syscall: two processes bouncing a byte over a socket pair; every round trip is a few blocking
  syscalls and two wake-ups: a storm of context switches and scheduler work.

Start-up is a handshake: each worker prepares (pins itself, allocates its buffers), says "ready"
on its pipe and waits; once all are ready the parent sends them one deadline, so `start()`
returns with the whole load on and the load lasts `duration_s` from then. Every worker stops by
itself at that deadline (CLOCK_MONOTONIC is one clock for all processes), as soon as its parent
is gone (it watches getppid), and on SIGTERM or SIGINT (Ctrl-C reaches the whole foreground
process group); then it reports the work it did over the same pipe.
This module imports only the standard library, so workers start in well under a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("spin", "memory", "syscall")
_SPIN_BATCH = 20_000  # loop iterations between stop checks (about a millisecond)
_PING_BATCH = 100  # round trips between stop checks
_STOP_GRACE_S = 3.0  # how long stop() waits for reports before it kills
_START_TIMEOUT_S = 60.0  # a worker not ready by then (an overloaded host) fails start()
_READY = "ready"

_stop_requested = False


@dataclass(frozen=True)
class InterferenceSpec:
    duration_s: float
    spin: int = 0  # spinning processes
    memory: int = 0  # memory-bandwidth processes
    syscall: int = 0  # ping-pong pairs (two processes each)
    memory_mib: int = 128  # size of each of a memory worker's two buffers
    cpus: tuple[int, ...] | None = None  # pin workers round-robin to these cores; None: anywhere

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"interference duration must be > 0 s, got {self.duration_s}")
        for name in ("spin", "memory", "syscall"):
            if getattr(self, name) < 0:
                raise ValueError(f"interference {name} must be >= 0")
        if self.spin + self.memory + self.syscall == 0:
            raise ValueError("interference needs at least one worker (spin, memory or syscall)")
        if self.memory_mib < 1:
            raise ValueError("interference memory_mib must be >= 1")
        if self.cpus is not None and not self.cpus:
            raise ValueError("interference cpus: an empty list")

    @classmethod
    def parse(cls, text: str, duration_s: float, cpus: tuple[int, ...] | None = None) -> InterferenceSpec:
        """From "spin=4,memory=1,syscall=2,memory_mib=64" (the keys are the fields)."""
        counts: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in (*KINDS, "memory_mib"):
                raise ValueError(
                    f"interference: expected spin=N,memory=N,syscall=N,memory_mib=N, got {part!r}"
                )
            try:
                counts[key] = int(value)
            except ValueError:
                raise ValueError(f"interference: {key} must be an integer, got {value!r}") from None
        return cls(duration_s=duration_s, cpus=cpus, **counts)

    def describe(self) -> str:
        return f"{self.describe_workers()} for {self.duration_s:g} s"

    def describe_workers(self) -> str:
        parts = [f"{self.spin} spin"] if self.spin else []
        if self.memory:
            parts.append(f"{self.memory} memory ({self.memory_mib} MiB x2)")
        if self.syscall:
            parts.append(f"{self.syscall} syscall pair{'s' if self.syscall > 1 else ''}")
        where = f" on cpus {','.join(map(str, self.cpus))}" if self.cpus else ""
        return f"{', '.join(parts)}{where}"


@dataclass(frozen=True)
class WorkerReport:
    kind: str
    index: int
    pid: int
    cpu: int | None
    seconds: float  # wall time the worker worked
    cpu_seconds: float  # its own user + system time
    ops: int  # loop iterations, bytes copied, or round trips (a "pong" side reports 0)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Worker:
    kind: str
    index: int
    cpu: int | None
    process: Any  # multiprocessing.process.BaseProcess
    channel: Any  # the parent's end of its pipe: "ready" and the report come in, the deadline goes out
    report: WorkerReport | None = None


# -- inside the workers ------------------------------------------------------------------------


def _request_stop(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def _should_stop(deadline: float, parent_pid: int) -> bool:
    return _stop_requested or time.monotonic() >= deadline or os.getppid() != parent_pid


def _spin(deadline: float, parent_pid: int, **_: Any) -> int:
    ops, x = 0, 1
    while not _should_stop(deadline, parent_pid):
        for _i in range(_SPIN_BATCH):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        ops += _SPIN_BATCH
    return ops


def _memory_buffers(memory_mib: int, **_: Any) -> dict[str, Any]:
    size = memory_mib * 2**20
    # Both written, so every page is real memory, not the shared zero page.
    return {"a": bytearray(b"\x5a" * size), "b": bytearray(b"\xa5" * size)}


def _memory(deadline: float, parent_pid: int, a: bytearray, b: bytearray, **_: Any) -> int:
    size = len(a)
    copied = 0
    while not _should_stop(deadline, parent_pid):
        b[:] = a
        a[:] = b
        copied += 2 * size
    return copied


def _ping(deadline: float, parent_pid: int, peer: Any, **_: Any) -> int:
    trips = 0
    try:
        while not _should_stop(deadline, parent_pid):
            for _i in range(_PING_BATCH):
                peer.send_bytes(b"x")
                peer.recv_bytes()
            trips += _PING_BATCH
    except (EOFError, OSError):  # the pong side went away
        pass
    finally:
        peer.close()  # the pong side sees EOF and ends too
    return trips


def _pong(deadline: float, parent_pid: int, peer: Any, **_: Any) -> int:
    try:
        while not _should_stop(deadline, parent_pid):
            if peer.poll(0.05):
                peer.send_bytes(peer.recv_bytes())
    except (EOFError, OSError):  # the ping side finished
        pass
    return 0


_WORK: dict[str, Callable[..., int]] = {"spin": _spin, "memory": _memory, "ping": _ping, "pong": _pong}


_PREPARE: dict[str, Callable[..., dict[str, Any]]] = {"memory": _memory_buffers}


def _await_deadline(channel: Any, parent_pid: int) -> float | None:
    """Block until the parent sends the deadline; None if it is gone or we are told to stop."""
    give_up = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < give_up and not _stop_requested and os.getppid() == parent_pid:
        try:
            if channel.poll(0.1):
                return float(channel.recv())
        except (EOFError, OSError):
            return None
    return None


def _worker_main(role: str, cpu: int | None, parent_pid: int, channel: Any, kwargs: dict[str, Any]) -> None:
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    prepare = _PREPARE.get(role)
    if prepare is not None:
        kwargs = {**kwargs, **prepare(**kwargs)}
    try:
        channel.send(_READY)
    except OSError:
        return
    deadline = _await_deadline(channel, parent_pid)
    if deadline is None:
        return
    wall0, cpu0 = time.monotonic(), time.process_time()
    ops = _WORK[role](deadline, parent_pid, **kwargs)
    try:
        channel.send((time.monotonic() - wall0, time.process_time() - cpu0, ops))
    except OSError:  # the parent is gone: nobody to tell
        pass


# -- the parent side ---------------------------------------------------------------------------


@dataclass
class Interference:
    """Start with `start()` (or `with Interference(spec):`); ends by itself after spec.duration_s."""

    spec: InterferenceSpec
    _workers: list[_Worker] = field(default_factory=list)
    started_at: float | None = None

    def start(self) -> None:
        if self._workers:
            raise RuntimeError("this interference has already started")
        ctx = multiprocessing.get_context("spawn")
        cpus = self.spec.cpus
        slot = 0

        def launch(kind: str, role: str, index: int, **kwargs: Any) -> None:
            nonlocal slot
            cpu = cpus[slot % len(cpus)] if cpus else None
            slot += 1
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(role, cpu, os.getpid(), theirs, kwargs),
                name=f"blink-interfere-{role}-{index}",
                daemon=True,  # ended at the parent's normal exit as well
            )
            proc.start()
            theirs.close()  # the worker holds its own copy; EOF here then means it died
            self._workers.append(_Worker(kind, index, cpu, proc, mine))

        try:
            for i in range(self.spec.spin):
                launch("spin", "spin", i)
            for i in range(self.spec.memory):
                launch("memory", "memory", i, memory_mib=self.spec.memory_mib)
            for i in range(self.spec.syscall):
                ping_end, pong_end = ctx.Pipe(duplex=True)
                launch("syscall", "ping", i, peer=ping_end)
                launch("syscall", "pong", i, peer=pong_end)
                # Only the two workers may hold the ends, or neither would ever see EOF.
                ping_end.close()
                pong_end.close()
            self._await_ready()
            self.started_at = time.monotonic()
            deadline = self.started_at + self.spec.duration_s
            for w in self._workers:
                w.channel.send(deadline)
        except BaseException:
            self.stop()
            raise

    def _await_ready(self) -> None:
        give_up = time.monotonic() + _START_TIMEOUT_S
        for w in self._workers:
            left = give_up - time.monotonic()
            try:
                ready = w.channel.poll(max(0.0, left)) and w.channel.recv() == _READY
            except (EOFError, OSError):
                ready = False
            if not ready:
                code = w.process.exitcode
                why = f"exited with {code}" if code is not None else f"not ready in {_START_TIMEOUT_S:g} s"
                raise RuntimeError(f"interference worker {w.process.name} did not start: {why}")

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    @property
    def running(self) -> bool:
        return any(w.process.is_alive() for w in self._workers)

    def _collect(self, worker: _Worker) -> None:
        if worker.report is not None:
            return
        try:
            if worker.channel.poll():
                seconds, cpu_seconds, ops = worker.channel.recv()
                worker.report = WorkerReport(
                    worker.kind, worker.index, worker.process.pid, worker.cpu, seconds, cpu_seconds, ops
                )
        except (EOFError, OSError):
            pass  # it died without reporting

    def wait(self, timeout_s: float | None = None) -> list[WorkerReport]:
        """Wait for every worker to end (by its deadline); the reports of those that finished."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for w in self._workers:
            w.process.join(None if end is None else max(0.0, end - time.monotonic()))
        return self.reports()

    def reports(self) -> list[WorkerReport]:
        for w in self._workers:
            if not w.process.is_alive():
                self._collect(w)
        return [w.report for w in self._workers if w.report is not None]

    def stop(self) -> list[WorkerReport]:
        """Ask every worker to stop now (SIGTERM), wait briefly, kill what is left."""
        for w in self._workers:
            if w.process.is_alive():
                w.process.terminate()
        self.wait(_STOP_GRACE_S)
        for w in self._workers:
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
        return self.reports()

    def __enter__(self) -> Interference:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summarize(reports: Sequence[WorkerReport]) -> list[str]:
    """One line per kind: how many workers and the work they did."""
    lines = []
    for kind, unit, scale, what in (
        ("spin", "M loops/s", 1e6, "spin"),
        ("memory", "GB/s copied", 1e9, "memory"),
        ("syscall", "round trips/s", 1.0, "syscall ping-pong"),
    ):
        mine = [r for r in reports if r.kind == kind]
        if not mine:
            continue
        total = sum(r.rate for r in mine) / scale
        busy = sum(r.cpu_seconds for r in mine) / max(max(r.seconds for r in mine), 1e-9)
        lines.append(f"{what}: {len(mine)} process(es), {total:,.1f} {unit}, {busy:.2f} cores busy")
    return lines


def run_interference(spec: InterferenceSpec, say: Callable[[str], None] = print) -> int:
    """Blocking: run the load for its duration (Ctrl-C stops it early) and print what it did."""
    load = Interference(spec)
    say(f"interference: {spec.describe()}")
    load.start()
    say(f"worker pids: {' '.join(map(str, load.pids))}")
    sys.stdout.flush()
    try:
        reports = load.wait(spec.duration_s + _STOP_GRACE_S)
        if load.running:  # a worker that missed its deadline
            reports = load.stop()
    except KeyboardInterrupt:
        say("interrupted: stopping")
        reports = load.stop()
    for line in summarize(reports):
        say(line)
    missing = len(load.pids) - len(reports)
    if missing:
        say(f"{missing} worker(s) ended without a report")
    return 0
