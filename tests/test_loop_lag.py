"""The front end's loop-lag meter (frontend/loop_lag.py): a callback that holds the event loop shows
as a late beat, and with a stacks file, as that callback's stack and its slow task step."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from blink_appliance.frontend.loop_lag import LoopLag

from tests.ring_support import wait_until_async


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a long callback does to every other task


async def test_a_held_loop_shows_as_a_late_beat_and_small_waits_do_not() -> None:
    lags: list[float] = []
    lag = LoopLag(lags.append)
    lag.start()
    try:
        await wait_until_async(lambda: len(lags) >= 5, "beats")
        assert max(lags) < 0.05  # an idle loop runs its beats (nearly) on time
        _hold_the_loop(0.08)
        await wait_until_async(lambda: max(lags) >= 0.05, "a late beat")
    finally:
        lag.stop()


async def test_the_stall_watcher_names_what_held_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "stalls.json"
    lag = LoopLag(lambda _: None, stacks_file=path)
    lag.start()

    async def busy_step() -> None:
        _hold_the_loop(0.06)
        await asyncio.sleep(0)

    def seen() -> bool:
        if not path.exists():
            return False
        record = json.loads(path.read_text())
        return any("_hold_the_loop" in key for key in record["stacks"]) and any(
            "busy_step" in key for key in record["slow_callbacks"]
        )

    try:
        task = asyncio.create_task(busy_step())
        await task
        await wait_until_async(seen, "the held loop's stack and step in the stacks file", 20.0)
    finally:
        lag.stop()
    record = json.loads(path.read_text())
    count, seconds, longest = next(v for k, v in record["slow_callbacks"].items() if "busy_step" in k)
    assert count == 1 and seconds >= 0.05 and longest >= 0.05
    # The late beat after it: the held callback accounts for the lateness, and is named.
    (beat,) = [b for b in record["late_beats"] if "busy_step" in b[4]]
    _, late_s, callbacks, callback_s, _, longest_s = beat
    assert late_s >= 0.05 and callbacks >= 1 and callback_s >= 0.05 and longest_s >= 0.05


async def test_a_late_beat_spent_outside_callbacks_is_not_charged_to_them(tmp_path: Path) -> None:
    """Time the loop thread spends outside callbacks (in the selector, or getting the GIL back
    after it) shows as a late beat with little callback time."""
    path = tmp_path / "stalls.json"
    loop = asyncio.get_running_loop()
    selector = loop._selector  # type: ignore[attr-defined]
    select = selector.select
    held = []

    def slow_select(timeout=None):  # type: ignore[no-untyped-def]
        events = select(timeout)
        if not held:
            held.append(True)
            time.sleep(0.06)
        return events

    lag = LoopLag(lambda _: None, stacks_file=path)
    lag.start()
    try:
        await asyncio.sleep(0.01)
        selector.select = slow_select

        def seen() -> bool:
            return path.exists() and any(b[1] >= 0.05 for b in json.loads(path.read_text())["late_beats"])

        await wait_until_async(seen, "the late beat in the stacks file", 20.0)
    finally:
        selector.select = select
        lag.stop()
    (beat,) = [b for b in json.loads(path.read_text())["late_beats"] if b[1] >= 0.05]
    assert beat[3] < 0.01, beat  # the callbacks since the beat before took almost none of it
