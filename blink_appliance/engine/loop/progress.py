"""Start-up progress of the GPU loop's build: what it is doing now and how long each part took.

A loop build compiles every kernel for its geometry (a minute on a fresh machine, more at large
geometries): the log says which part is running, so a slow or stuck start shows where it is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch

log = logging.getLogger("blink_appliance.engine.loop")


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Log `what ...` now and `what: done in N s` when the block ends."""
    log.info("%s ...", what)
    t0 = time.monotonic()
    yield
    log.info("%s: done in %.1f s", what, time.monotonic() - t0)


class CompileAhead:
    """`compile` run on a thread of its own, started now and waited for by `wait()`.

    Triton's compiler passes release the GIL, so a kernel that only needs compiling (the schedule
    kernel: 37 s cold at the shipped geometry on the H200) builds while the main thread compiles and
    warms the forward's buckets. `device` is made current on the thread: Triton files a compiled
    kernel under the current device. An exception on the thread is raised again by `wait()`."""

    def __init__(self, what: str, compile: Callable[[], None], device: torch.device) -> None:
        self.what = what
        self._compile = compile
        self._device = device
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="compile-ahead", daemon=True)
        log.info("%s: started in the background ...", what)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
                self._compile()
        except BaseException as e:  # raised again on the main thread by wait()
            self._error = e
            return
        log.info("%s: compiled in %.1f s", self.what, time.monotonic() - t0)

    def wait(self) -> None:
        """Block until the compile is done (logged as its own stage: the time the start-up still
        waits for it), then raise what it raised, if anything."""
        with stage(f"{self.what}: waiting for it"):
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"{self.what} failed: {self._error}") from self._error
