"""Which part of its GPU each served model gets, from the profile's models (telemetry/snapshot.py's
SmShare): the front end works it out once and the dashboard shows it next to the engine's counters."""

from __future__ import annotations

from collections.abc import Iterable

from blink_appliance.telemetry.snapshot import SmShare


def sm_shares(models: Iterable[tuple[str, str, int | None]]) -> dict[str, SmShare | None]:
    """`(name, device, sm_count)` per model -> its SmShare; None for a model on the CPU."""
    models = list(models)
    partitioned = {device for _, device, sm_count in models if sm_count is not None}
    shares: dict[str, SmShare | None] = {}
    for name, device, sm_count in models:
        if device == "cpu":
            shares[name] = None
        elif sm_count is not None:
            shares[name] = SmShare(kind="partition", sm_count=sm_count)
        else:  # without a count of its own it runs on whatever SMs the partitions leave
            shares[name] = SmShare(kind="rest" if device in partitioned else "whole")
    return shares
