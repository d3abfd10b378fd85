"""The interference verdict: is other work on this host taking the CPU the appliance needs?

Two measurements feed it (host.py takes both on every sample):
  - others' share: host CPU busy minus the appliance's own processes (daemon, front end, engine),
    as a share of the whole host. It says who is on the cores.
  - run-queue delay: ms per second that the appliance's threads were ready to run but waited for a
    core (runqueue.py). It says whether the appliance actually waited.

Others' share alone decides up to "contended"; the run-queue delay can raise the verdict, but only
once others hold at least OTHERS_FLOOR_PERCENT of the host: with nobody else on the cores, a wait is
the appliance queueing behind its own threads (shown on screen, but not interference).
Why these thresholds (docs/dashboard.md has the measurements): a busy loop on every core leaves the
others at least half the host whatever the appliance does, so it reads "contended"; an idle host's
background (a few %) stays under the 20% at which the verdict leaves "quiet".
"""

from __future__ import annotations

from typing import Literal

Verdict = Literal["quiet", "busy", "contended"]

OTHERS_BUSY_PERCENT = 20.0  # others hold a fifth of the host: the appliance has less headroom
OTHERS_CONTENDED_PERCENT = 50.0  # others hold half the host or more
OTHERS_FLOOR_PERCENT = 10.0  # below this, run-queue delay is the appliance's own
RUNQUEUE_BUSY_MS_PER_S = 50.0  # the appliance's threads waited 5% of the time (summed)
RUNQUEUE_CONTENDED_MS_PER_S = 200.0  # ... a fifth of the time

_LEVELS: tuple[Verdict, ...] = ("quiet", "busy", "contended")


def interference_verdict(
    others_share_percent: float | None, runqueue_ms_per_s: float | None
) -> Verdict | None:
    """The verdict for one sample; None before there is a rate to judge (the first sample)."""
    if others_share_percent is None:
        return None
    level = 0
    if others_share_percent >= OTHERS_CONTENDED_PERCENT:
        level = 2
    elif others_share_percent >= OTHERS_BUSY_PERCENT:
        level = 1
    if runqueue_ms_per_s is not None and others_share_percent >= OTHERS_FLOOR_PERCENT:
        if runqueue_ms_per_s >= RUNQUEUE_CONTENDED_MS_PER_S:
            level = 2
        elif runqueue_ms_per_s >= RUNQUEUE_BUSY_MS_PER_S:
            level = max(level, 1)
    return _LEVELS[level]
