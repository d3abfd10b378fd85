"""How late the front end's event loop runs, and, when asked, what held it.

Every stream and every new request waits while one callback holds the loop, so its lateness is the
front end's share of a token's latency. A beat scheduled every BEAT_S measures how late it ran
(`blink_frontend_loop_lag_seconds`). With BLINK_FRONTEND_STALL_STACKS=<file> set, a watcher thread
also samples the loop thread's stack whenever the beat is more than STALL_S overdue (as often as
the GIL's switch interval lets it in: the front end sets 1 ms), and rewrites <file> once a second
with a JSON count of the stacks seen and of the callbacks that ran longer than SLOW_S, by the
coroutines they resumed (a bench's tool for finding the stalls). Each beat later than RECORD_S is
also kept (`late_beats`): when, how late, and how many callbacks ran since the beat before and for
how long in all, which tells loop work (many callbacks) from time the loop thread spent outside
them (waiting for the GIL or a CPU). The other threads' stacks seen during stalls are counted too.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

BEAT_S = 0.002
STALL_S = 0.004
SLOW_S = 0.002
RECORD_S = 0.008
KEYED_S = 0.0005
LATE_BEATS_KEPT = 4000
STACK_ENV = "BLINK_FRONTEND_STALL_STACKS"
_OWN = ("frontend/", "blink_appliance/", "aiohttp/", "asyncio/")


def callback_key(handle: asyncio.Handle) -> str:
    """A callback by what it runs: a task step by the chain of coroutines it is suspended in now, outermost first."""
    callback = handle._callback  # type: ignore[attr-defined]
    task = getattr(callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return getattr(callback, "__qualname__", type(callback).__name__)
    names, awaited = [], task.get_coro()
    while awaited is not None and len(names) < 12:
        code = getattr(awaited, "cr_code", None) or getattr(awaited, "ag_code", None)
        if code is None:
            break
        names.append(code.co_qualname)
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return " > ".join(names) or type(callback).__name__


def stack_key(frame: FrameType | None, depth: int = 8) -> str:
    """The innermost frame, then the `depth` innermost of ours and aiohttp's and asyncio's, innermost first."""
    parts: list[str] = []
    leaf = True
    while frame is not None and len(parts) < depth + 1:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if leaf or any(p in path for p in _OWN):
            place = "/".join(path.rsplit("/", 2)[-2:])  # its folder and file: "wire/client.py"
            parts.append(f"{place}:{frame.f_code.co_name}:{frame.f_lineno}")
        leaf = False
        frame = frame.f_back
    return " < ".join(parts)


class LoopLag:
    """Times the loop's lateness into `observe` (seconds), and samples stall stacks into `stacks_file`."""

    def __init__(self, observe: Callable[[float], None], stacks_file: Path | None = None) -> None:
        self._observe = observe
        self._stacks_file = stacks_file
        self.stacks: collections.Counter[str] = collections.Counter()
        self.slow: dict[str, list[float]] = {}  # callback_key: [count, seconds, longest]
        self.other_threads: collections.Counter[str] = collections.Counter()
        # [monotonic s, lag s, callbacks since the beat before, their seconds, the longest one's key, its s]
        self.late_beats: collections.deque[list] = collections.deque(maxlen=LATE_BEATS_KEPT)
        self._since_beat = [0, 0.0, "", 0.0]  # callbacks, seconds, longest key, longest seconds
        self._run_handle: Callable[[asyncio.Handle], None] | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, observe: Callable[[float], None]) -> LoopLag:
        path = os.environ.get(STACK_ENV)
        return cls(observe, Path(path) if path else None)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + BEAT_S
        self._handle = loop.call_at(self._due, self._beat, loop)
        if self._stacks_file is not None:
            self._time_callbacks()
            ident = threading.get_ident()
            self._thread = threading.Thread(target=self._watch, args=(ident,), daemon=True)
            self._thread.start()

    def _time_callbacks(self) -> None:
        run = self._run_handle = asyncio.Handle._run  # type: ignore[attr-defined]
        slow, since = self.slow, self._since_beat

        def timed(handle: asyncio.Handle) -> None:
            started = time.perf_counter()
            run(handle)
            took = time.perf_counter() - started
            since[0] += 1
            since[1] += took
            if took > since[3] and took > KEYED_S:  # naming a callback walks its coroutines: only long ones
                since[2], since[3] = callback_key(handle), took
            if took > SLOW_S:
                entry = slow.setdefault(callback_key(handle), [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += took
                entry[2] = max(entry[2], took)

        asyncio.Handle._run = timed  # type: ignore[method-assign]

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._run_handle is not None:
            asyncio.Handle._run = self._run_handle  # type: ignore[method-assign]
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            self._write()

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        lag = max(0.0, now - self._due)
        self._observe(lag)
        if self._stacks_file is not None:
            since = self._since_beat
            if lag > RECORD_S:
                self.late_beats.append([round(now, 4), round(lag, 5), since[0], round(since[1], 5), since[2],
                                        round(since[3], 5)])  # fmt: skip
            since[:] = [0, 0.0, "", 0.0]
        self._due = now + BEAT_S
        self._handle = loop.call_at(self._due, self._beat, loop)

    def _watch(self, ident: int) -> None:
        written = time.monotonic()
        while not self._stop.wait(BEAT_S / 2):
            # loop.time() is time.monotonic(): the beat's due time compares with it from this thread.
            if time.monotonic() - self._due > STALL_S:
                frames = sys._current_frames()
                self.stacks[stack_key(frames.get(ident))] += 1
                for other, frame in frames.items():
                    if other not in (ident, threading.get_ident()):
                        self.other_threads[stack_key(frame, depth=4)] += 1
            if time.monotonic() - written > 1.0:
                self._write()
                written = time.monotonic()

    def _write(self) -> None:
        assert self._stacks_file is not None
        tmp = self._stacks_file.with_suffix(".tmp")
        # list() copies in one C call, which the loop thread cannot interleave with.
        slow = sorted(list(self.slow.items()), key=lambda kv: -kv[1][1])
        stacks, others, late = (
            list(self.stacks.items()),
            list(self.other_threads.items()),
            list(self.late_beats),
        )
        tmp.write_text(json.dumps({
            "stacks": dict(stacks), "slow_callbacks": dict(slow), "other_threads": dict(others), "late_beats": late,
        }))  # fmt: skip
        tmp.replace(self._stacks_file)
