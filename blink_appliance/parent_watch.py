"""Stop a child server when the process that started it is gone (it was killed, so it cannot)."""

from __future__ import annotations

import asyncio
import os
import threading


def watch_parent(parent_pid: int, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """From a daemon thread, set `stop` on `loop` once this process's parent is no longer `parent_pid`
    (the orphan is re-parented); checked every half second."""

    def watch() -> None:
        while not stop.is_set():
            if os.getppid() != parent_pid:
                loop.call_soon_threadsafe(stop.set)
                return
            threading.Event().wait(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
