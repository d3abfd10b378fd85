"""Whether the engine behind a region is alive, judged by the client from the engine's own words:
its state RUNNING (or away from it briefly) and its heartbeat moving on this process's clock (no
shared clock needed: it works from a DPU). docs/protocol.md, "Liveness"."""

from __future__ import annotations

import time

from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.ring_layout import EngineState

# How long engine_state must read other than RUNNING, after it read RUNNING, before the engine counts
# as gone: a live engine puts a stray write back within a heartbeat (wire/lifecycle.py Heartbeat.hold).
STATE_GRACE_S = 0.25
# How long the heartbeat may stand still before the engine counts as stuck (docs/reliability.md): a
# shorter stall makes streams wait; an engine that exits is seen at once through engine_state. The
# profile's engine.stall_limit_s, whose default this is, sets it for the daemon and the front end.
ENGINE_STALL_LIMIT_S = 10.0


class EngineWatch:
    def __init__(self, stall_limit_s: float) -> None:
        self.stall_limit_ns = int(stall_limit_s * 1e9)
        self._beat_value = 0
        self._beat_seen_ns = 0
        self._state_bad_since_ns: int | None = 0  # not RUNNING since then (None: RUNNING); 0: never seen it

    def restart(self, region: RingRegion) -> None:
        """Watch from now on: the heartbeat must move before the engine counts as alive."""
        self._beat_value = region.load("engine_heartbeat_ns")
        self._beat_seen_ns = time.monotonic_ns() - self.stall_limit_ns - 1
        self._state_bad_since_ns = 0

    def alive(self, region: RingRegion) -> bool:
        """RUNNING (or away from it for less than STATE_GRACE_S) and its heartbeat advanced within
        the stall limit."""
        now = time.monotonic_ns()
        beat = region.load("engine_heartbeat_ns")
        if beat != self._beat_value:
            self._beat_value, self._beat_seen_ns = beat, now
        if region.load("engine_state") == EngineState.RUNNING:
            self._state_bad_since_ns = None
        elif self._state_bad_since_ns is None:
            self._state_bad_since_ns = now
        state_ok = self._state_bad_since_ns is None or (
            self._state_bad_since_ns > 0 and now - self._state_bad_since_ns < STATE_GRACE_S * 1e9
        )
        return state_ok and now - self._beat_seen_ns <= self.stall_limit_ns

    def why_dead(self, region: RingRegion) -> str:
        """Which half of `alive` failed, for the error a caller sees."""
        state = region.load("engine_state")
        if state != EngineState.RUNNING:
            try:
                return f"engine state {EngineState(state).name}"
            except ValueError:
                return f"engine state word {state}"
        age_s = (time.monotonic_ns() - self._beat_seen_ns) / 1e9
        return f"heartbeat last advanced {age_s:.1f} s ago, limit {self.stall_limit_ns / 1e9:g} s"
