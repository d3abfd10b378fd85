"""Start-up progress of the GPU loop's build: what it is doing now and how long each part took.

A loop build compiles every kernel for its geometry (a minute on a fresh machine, more at large
geometries): the log says which part is running, so a slow or stuck start shows where it is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("blink_appliance.engine.loop")


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Log `what ...` now and `what: done in N s` when the block ends."""
    log.info("%s ...", what)
    t0 = time.monotonic()
    yield
    log.info("%s: done in %.1f s", what, time.monotonic() - t0)
