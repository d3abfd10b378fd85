"""What every engine on the rings does around its token path: take the region for a new epoch,
finish channels a dead epoch left open, heartbeat, publish terminal events, drain the request ring;
ServerLifecycle puts the steps both ring servers take the same way together.

Two engines build on it: EngineServer (the CPU reference engine, Python on the token path) and
LoopEngineServer (the GPU loop, kernels on the token path). The protocol these helpers follow is
docs/protocol.md ("Slot ownership", "Liveness", "Engine restart").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.ring_layout import FINAL_BIT, FINISH_CODES, EngineState, ErrorCode

log = logging.getLogger(__name__)

# Value of the `shutdown` word an engine writes for itself (on SIGTERM) so that a loop which only
# reads the ring learns of it. The daemon writes 1; an engine takes back only its own 2 when it
# exits, so a later engine epoch on the same region is not stopped by an old signal.
ENGINE_SHUTDOWN_REQUEST = 2
# How often an engine writes its heartbeat word; the front end's liveness limit is a multiple of it.
HEARTBEAT_INTERVAL_S = 0.05
# How long the front end's heartbeat may stand still before an engine reclaims its requests.
FRONTEND_TIMEOUT_S = 5.0


def mark_engine_exited(region: RingRegion) -> None:
    """The supervisor saw the engine process exit: unless it stopped cleanly, its state is FAILED,
    so the front end fails its streams now instead of waiting out the heartbeat's stall limit."""
    if region.load("engine_state") in (EngineState.STARTING, EngineState.RUNNING):
        region.store("engine_state", EngineState.FAILED)


def begin_epoch(region: RingRegion) -> int:
    """Take the region: state STARTING, epoch + 1, our pid. Returns the new epoch."""
    region.store("engine_state", EngineState.STARTING)
    epoch = region.load("engine_epoch") % (2**64 - 1) + 1  # a corrupt word wraps, never overflows; never 0
    region.store("engine_epoch", epoch)
    region.store("engine_pid", os.getpid())
    return epoch


def inconsistent_rings(region: RingRegion) -> dict[str, str]:
    """The rings ("req", "arena") whose head and tail words contradict each other: a head behind its
    tail, or further ahead of it than the ring holds; each with what was read. Empty for any region
    the protocol can produce."""
    g = region.geometry
    faults = {}
    for ring, capacity in (("req", g.request_slots), ("arena", g.arena_tokens)):
        head, tail = region.load(f"{ring}_head"), region.load(f"{ring}_tail")
        if not 0 <= head - tail <= capacity:
            faults[ring] = f"{ring}_head {head}, {ring}_tail {tail}, capacity {capacity}"
    return faults


def reset_inconsistent_rings(region: RingRegion) -> dict[str, str]:
    """At the start of an epoch, before anything is read at the tails: a ring whose words contradict
    each other (random bytes over the region) restarts empty at its head, so the engine reads where
    the front end writes next. Records queued behind a bad tail are dropped; their channels end with
    engine_restarted like every other one this epoch does not find queued. Returns what it reset."""
    faults = inconsistent_rings(region)
    for ring, what in faults.items():
        log.error("the %s ring's words contradict each other at engine start (%s): it restarts at its head",
                  ring, what)  # fmt: skip
        region.store(f"{ring}_tail", region.load(f"{ring}_head"))
    return faults


def queued_channels(region: RingRegion) -> set[tuple[int, int]]:
    """(slot, generation) of every record published and not yet consumed (at most a ring's worth:
    a corrupt head must not make this walk 2**64 positions)."""
    queued: set[tuple[int, int]] = set()
    tail = region.load("req_tail")
    head = min(max(region.load("req_head"), tail), tail + region.geometry.request_slots)
    for position in range(tail, head):
        if region.record_seq(position) == position + 1:
            record = region.read_record(position)[0]
            queued.add((int(record["slot"]), int(record["generation"])))
    return queued


def finish_abandoned_channels(region: RingRegion, held: np.ndarray, tail: int) -> list[int]:
    """ABORT on every channel the front end cancelled (cancel == generation != done) that this
    engine does not hold (`held`: per slot the generation it serves, 0 for none) and no record at
    or after `tail` will bring: nobody else would ever finish it, so its slot would stay taken. A new
    front end cancels every channel it finds open, which is how a done word overwritten on a free
    slot looks. A cancel is written only after its record was published, so a claim in progress is
    never taken for one of these. Returns their slots."""
    ctl, prog = region.ctl_table(), region.progress_table()
    generation = ctl["generation"]
    candidates = (
        (generation != prog["done"]) & (ctl["cancel"] == generation) & (generation != 0) & (held == 0)
    )
    if not candidates.any():
        return []
    queued: set[tuple[int, int]] = set()
    position = tail
    while position < tail + region.geometry.request_slots and region.record_seq(position) == position + 1:
        record = region.read_record(position)[0]
        queued.add((int(record["slot"]), int(record["generation"])))
        position += 1
    finished = []
    for slot in (int(s) for s in candidates.nonzero()[0]):
        if (slot, int(generation[slot])) not in queued:
            write_terminal(region, slot, int(generation[slot]), FinishReason.ABORT, ErrorCode.NONE, "")
            finished.append(slot)
    if finished:
        log.warning(
            "finished %d cancelled channels that no engine served (slots %s)", len(finished), finished
        )
    return finished


def finish_open_channels(region: RingRegion, reason: FinishReason, code: ErrorCode, detail: str) -> list[int]:
    """Terminal event on every channel the engine side owns (generation != done) whose record is
    no longer queued: requests an engine took and will never finish. Returns their slots.

    Only call it when no engine is writing channels: at the start of an epoch, or after this
    epoch's token path has stopped. Queued records are left for whoever reads the ring next.
    """
    queued = queued_channels(region)
    ctl, prog = region.ctl_table(), region.progress_table()
    finished = []
    for slot in (int(s) for s in (ctl["generation"] != prog["done"]).nonzero()[0]):
        generation = int(ctl["generation"][slot])
        if (slot, generation) not in queued:
            write_terminal(region, slot, generation, reason, code, detail)
            finished.append(slot)
    return finished


def write_terminal(
    region: RingRegion,
    slot: int,
    generation: int,
    reason: FinishReason,
    code: ErrorCode,
    detail: str,
    *,
    token: bool = False,
    stamp: int = 0,
    count: int | None = None,
) -> None:
    """Status, then the final count (| FINAL_BIT), then done = generation: after that last store
    the slot is the front end's. `count` None: keep what the channel already holds."""
    if count is None:
        count = region.load_progress(slot, "count") & ~FINAL_BIT
    region.write_status(
        slot,
        finish_ns=stamp or time.monotonic_ns(),
        finish_code=FINISH_CODES[reason],
        error_code=int(code),
        terminal_token=token,
        detail=detail,
    )
    region.store_progress(slot, "count", count | FINAL_BIT)
    region.store_progress(slot, "done", generation)


def release_arena(region: RingRegion, arena_tail: int, arena_end: int) -> int:
    """Release prompt tokens up to a record's `arena_end`, clamped to [arena_tail, arena_head] so a
    bad record cannot corrupt the counter, and never backwards, even when the arena_head word reads
    below the tail (overwritten): a tail moved back makes the arena look full for good. Returns the
    new arena tail."""
    end = max(min(arena_end, region.load("arena_head")), arena_tail)
    if end != arena_tail:
        region.store("arena_tail", end)
    return end


def drain_ring(region: RingRegion, reason: FinishReason, code: ErrorCode, detail: str) -> int:
    """Consume every published record without running it, finishing its channel; returns how many.

    Reads and advances the consumer words (req_tail, arena_tail) in the region itself, so the
    caller must be the ring's only consumer now.
    """
    tail, arena_tail = region.load("req_tail"), region.load("arena_tail")
    drained = 0
    while region.record_seq(tail) == tail + 1:
        record = region.read_record(tail)[0]
        slot, generation = int(record["slot"]), int(record["generation"])
        arena_tail = release_arena(region, arena_tail, int(record["arena_end"]))
        if (
            slot < region.geometry.max_inflight
            and generation
            and region.load_ctl(slot, "generation") == generation
        ):
            write_terminal(region, slot, generation, reason, code, detail)
        tail += 1
        region.store("req_tail", tail)
        drained += 1
    return drained


def request_shutdown(region: RingRegion) -> None:
    """Ask the token path to stop through the ring's shutdown word (unless someone already did)."""
    if not region.load("shutdown"):
        region.store("shutdown", ENGINE_SHUTDOWN_REQUEST)


def withdraw_shutdown_request(region: RingRegion) -> None:
    """Clear the shutdown word if it still holds this engine's own request (see ENGINE_SHUTDOWN_REQUEST)."""
    if region.load("shutdown") == ENGINE_SHUTDOWN_REQUEST:
        region.store("shutdown", 0)


class Heartbeat:
    """Writes engine_heartbeat_ns (CLOCK_MONOTONIC) every `interval_s`, from a thread of its own so
    a long step is not mistaken for death; it dies with the process, which the daemon notices.

    While `hold(state)` is in force it also puts engine_state back to that state if anything else
    wrote the word: the engine owns it, and a stray write must not make a live engine look dead; and
    engine_pid back to this process's, which the front end's telemetry follows."""

    def __init__(self, region: RingRegion, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.region = region
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a state change and a beat's repair never interleave
        self._held: int | None = None
        self.repairs = 0  # engine_state and engine_pid words put back
        self._pid = os.getpid()

    def beat(self) -> None:
        with self._lock:
            self.region.store("engine_heartbeat_ns", time.monotonic_ns())
            if self._held is None:
                return
            for word, ours in (("engine_state", self._held), ("engine_pid", self._pid)):
                if self.region.load(word) != ours:
                    self.region.store(word, ours)
                    self.repairs += 1

    def hold(self, state: int | None) -> None:
        """Write engine_state = `state` and keep it so (None: write nothing, keep nothing)."""
        with self._lock:
            self._held = state
            if state is not None:
                self.region.store("engine_state", state)

    def start(self) -> None:
        self._stop.clear()  # a server may run again after a stop
        self.beat()
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()


class Throttle:
    """`due()` is true at most once per interval (CLOCK_MONOTONIC), the first call included: how
    often an engine copies its counters into the telemetry block between steps."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._interval_ns = int(interval_s * 1e9)
        self._last_ns: int | None = None

    def due(self) -> bool:
        now = time.monotonic_ns()
        if self._last_ns is not None and now - self._last_ns < self._interval_ns:
            return False
        self._last_ns = now
        return True


class FrontendWatch:
    """The front end's heartbeat word seen through our own clock: lost once the word has not
    changed for `timeout_s` (the clocks of the two processes are never compared)."""

    def __init__(self, region: RingRegion, timeout_s: float) -> None:
        self.region = region
        self.timeout_ns = int(timeout_s * 1e9)
        self._beat = 0
        self._seen_ns = 0

    def restart(self) -> None:
        """Count from now, so a new epoch gives the front end a whole timeout."""
        self._beat, self._seen_ns = self.region.load("frontend_heartbeat_ns"), time.monotonic_ns()

    def lost(self) -> bool:
        """True at most once a timeout while the word stands still: the caller reclaims, and a
        front end that still has not come back is reported again one timeout later."""
        now = time.monotonic_ns()
        beat = self.region.load("frontend_heartbeat_ns")
        if beat != self._beat:
            self._beat, self._seen_ns = beat, now
            return False
        if now - self._seen_ns <= self.timeout_ns:
            return False
        self._seen_ns = now
        return True


class ServerLifecycle:
    """What both ring servers do the same way around their token path: take the region for a new
    epoch, mark it RUNNING, STOPPED or FAILED, beat, watch the front end's heartbeat, and refresh
    the telemetry block at most once per `telemetry_interval_s`.

    `telemetry_values` reads the engine's telemetry words (TELEMETRY_FIELDS names, but updated_ns,
    which is stamped here): each engine reads its counters its own way.
    """

    def __init__(
        self,
        region: RingRegion,
        telemetry_values: Callable[[], Mapping[str, float]],
        *,
        heartbeat_interval_s: float,
        telemetry_interval_s: float,
        frontend_timeout_s: float,
    ) -> None:
        self.region = region
        self.heartbeat = Heartbeat(region, heartbeat_interval_s)
        self.frontend = FrontendWatch(region, frontend_timeout_s)
        self.telemetry = Throttle(telemetry_interval_s)
        self._telemetry_values = telemetry_values

    def begin(self) -> None:
        """Take the region for a new epoch (state STARTING): a ring whose head and tail words contradict
        each other restarts at its head, channels open without a queued record were taken by an epoch
        that died and get engine_restarted (queued records will be served), the front end's timeout
        counts from now, heartbeat and telemetry are fresh. The caller calls `serving` once its token
        path runs."""
        r = self.region
        reset_inconsistent_rings(r)  # before the epoch: a front end that sees the epoch sees the reset
        begin_epoch(r)
        finish_open_channels(r, FinishReason.ERROR, ErrorCode.ENGINE_RESTARTED, "engine restarted")
        self.frontend.restart()
        self.heartbeat.beat()
        self.write_telemetry()

    def serving(self) -> None:
        self.heartbeat.hold(EngineState.RUNNING)

    def stopped(self) -> None:
        """The last telemetry, then STOPPED: the engine exits cleanly."""
        self.write_telemetry()
        self.heartbeat.hold(None)
        self.region.store("engine_state", EngineState.STOPPED)

    def failed(self) -> None:
        self.heartbeat.hold(None)
        self.region.store("engine_state", EngineState.FAILED)

    def maybe_write_telemetry(self) -> None:
        if self.telemetry.due():
            self.write_telemetry()

    def write_telemetry(self) -> None:
        self.region.write_telemetry({**self._telemetry_values(), "updated_ns": time.monotonic_ns()})
