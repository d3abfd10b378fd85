"""The front end's pump over the output channels: one task on the event loop polls every open channel,
delivers what the engine published to the requests' queues, frees slots the engine is done with, and
writes the front end's heartbeat. EngineClient (client.py) is a ChannelPump: the pump reads the slot
state `submit` writes, so both live on one object; this module holds the reading side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from blink_appliance.wire.channels import ChannelBounds, Pending, slots_to_read, terminal_written
from blink_appliance.wire.engine_watch import EngineWatch
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason
from blink_appliance.wire.request_areas import RequestAreas
from blink_appliance.wire.ring_cursor import RingCursor
from blink_appliance.wire.ring_layout import FINAL_BIT

log = logging.getLogger(__name__)

# How often the pump looks for requests past their deadline and checks the ring's words.
TIMEOUT_CHECK_NS = 100_000_000


class ChannelPump:
    """The pump's half of EngineClient; EngineClient.__init__ sets every attribute named here."""

    region: RingRegion
    request_timeout_ns: int
    poll_interval_s: float
    control_interval_ns: int
    spin_ns: int
    payload_timeout_ns: int
    payload_waits: int
    _watch: EngineWatch
    _timeouts_checked_ns: int
    _control_checked_ns: int
    _alive: bool
    _lost: str | None
    _active_ns: int
    _nap_future: asyncio.Future[None] | None
    _tracked_gen: np.ndarray  # generation we wait on per slot; 0 = free
    _delivered: np.ndarray  # tokens read from each slot
    _whole: np.ndarray  # the slot's response is sent whole (read in batches)
    _bounds: ChannelBounds
    _by_slot: dict[int, Pending]
    _by_id: dict[int, Pending]
    _free: deque[int]
    _areas: RequestAreas
    _ring: RingCursor
    _why_dead: Callable[[], str]  # EngineClient's: why the engine counts as dead, for the streams it ends

    async def _run_pump(self) -> None:
        while True:
            now = time.monotonic_ns()
            if self._lost is None:
                self._pump_pass(now)
            if self._lost is None and bool(self._by_slot) and now - self._active_ns < self.spin_ns:
                await asyncio.sleep(0)
            else:
                await self._nap(self.poll_interval_s)

    def _pump_pass(self, now: int) -> None:
        control = now - self._control_checked_ns >= self.control_interval_ns
        if control:
            self._control_checked_ns = now
            self.region.store("frontend_heartbeat_ns", now)
        if self._poll_channels():
            self._active_ns = now
        if control:
            self._alive = self._watch.alive(self.region)
        if not self._alive and any(not p.terminated for p in self._by_id.values()):
            self._fail_pending(f"engine is dead: {self._why_dead()}")
        if now - self._timeouts_checked_ns > TIMEOUT_CHECK_NS:
            self._timeouts_checked_ns = now
            if self.request_timeout_ns:
                self._fail_late(now)
            self._ring.check(now)  # heads held, and tails followed without waiting for traffic

    async def _nap(self, seconds: float) -> None:
        """Sleep that `submit` can cut short (no syscall: just resolves a future on this loop)."""
        loop = asyncio.get_running_loop()
        self._nap_future = loop.create_future()
        handle = loop.call_later(seconds, self._wake)
        try:
            await self._nap_future
        finally:
            handle.cancel()
            self._nap_future = None

    def _wake(self) -> None:
        if self._nap_future is not None and not self._nap_future.done():
            self._nap_future.set_result(None)

    def _poll_channels(self) -> bool:
        """One pass over the tracked channels; True if any event was delivered or slot freed."""
        if not self._tracked_gen.any():
            return False
        prog = self.region.progress_table()
        tracked = self._tracked_gen != 0
        counts = prog["count"] & np.uint64(FINAL_BIT - 1)
        final = (prog["count"] & np.uint64(FINAL_BIT)) != 0
        done = tracked & (prog["done"] == self._tracked_gen)
        bad_done = tracked & ~done & self._bounds.bad_done(prog["done"], self._tracked_gen)
        moved, bounds, ends = False, self._bounds, done | bad_done | final
        slots = slots_to_read(tracked, ends, counts, self._delivered, self._whole, bounds)
        # Streams that only got tokens: their tokens and stamps in one read (one transfer over NIXL).
        # (Words the engine cannot have written are left to _drain_slot, which finds them out.)
        flowing = [
            int(s) for s in slots
            if not (ends[s] | bounds.faulted[s])
            and self._delivered[s] < counts[s] <= bounds.max_tokens[s]
        ]  # fmt: skip
        spans = [(s, int(self._delivered[s]), int(counts[s])) for s in flowing]
        read = dict(zip(flowing, self.region.read_outputs(spans), strict=True)) if len(spans) > 1 else {}
        for slot in slots:
            s = int(slot)
            moved |= self._drain_slot(s, bool(done[s]), int(prog["done"][s]) if bad_done[s] else None,
                                      int(prog["count"][s]), read.get(s))  # fmt: skip
        return moved

    def _drain_slot(
        self, slot: int, done: bool, bad_done: int | None, count_word: int, read: tuple | None = None
    ) -> bool:
        """Deliver what the channel published since the last pass; `bad_done` is a done word the
        engine cannot have written (None: it is fine); `read`: its new tokens and stamps, if read."""
        r = self.region
        if done:
            count_word = r.load_progress(slot, "count")  # re-read after seeing done: now final
        final = bool(count_word & FINAL_BIT)
        count = count_word & (FINAL_BIT - 1)
        start = int(self._delivered[slot])
        pending = self._by_slot.get(slot)
        # The slot may come back on a done word only once the engine's terminal status is there: a
        # done written early by something else must not hand back a slot the engine still serves.
        ended = (done or bad_done is not None) and terminal_written(self.region, slot)
        bounds = self._bounds
        if bounds.faulted[slot]:
            return self._faulted_channel(slot, pending, None, release=ended)
        # A done word overwritten after a whole terminal is harmless: the engine is finished.
        finished = ended and bad_done is not None and final and start <= count <= bounds.max_tokens[slot]
        generation = int(self._tracked_gen[slot])
        fault = bounds.fault(slot, generation, start, count, final, done, None if finished else bad_done)
        if fault is not None:
            return self._faulted_channel(slot, pending, fault, release=ended)
        moved = False
        if pending is not None and not pending.terminated and (count > start or final):
            tokens, times = read if read is not None else r.read_output(slot, start, max(start, count))
            status = r.read_status(slot) if final else None
            unwritten = np.flatnonzero(times == 0)
            arrived = int(unwritten[0]) if unwritten.size else len(times)
            if arrived < len(times) or (status is not None and status["finish_ns"] == 0):
                # The publishing word arrived before the payload it covers (stamps and finish_ns are
                # never 0 once written; claim zeroed them): deliver what is there, wait for the rest.
                return self._wait_for_payload(pending, slot, start, tokens, times, arrived, final)
            pending.payload_wait_since_ns = 0
            terminal_token = bool(final and status["terminal_token"] and count > start)
            pending.deliver(tokens, times, len(tokens) - int(terminal_token))
            if terminal_token:
                pending.emit_terminal(status, int(tokens[-1]), int(times[-1]))
            if final and not pending.terminated:
                pending.emit_terminal(status, None, int(status["finish_ns"]))
            if pending.terminated and not final:  # ended on a bad logprob row: the engine stops too
                r.store_ctl(slot, "cancel", pending.generation)
            moved = True
        self._delivered[slot] = count
        if finished:
            log.error("output channel %d: done word %d was overwritten after the engine finished the "
                      "request; the slot is free again", slot, bad_done)  # fmt: skip
        if ended:
            self._release(slot)
            moved = True
        return moved

    def _faulted_channel(self, slot: int, pending: Pending | None, fault: str | None, release: bool) -> bool:
        """A channel whose words were overwritten (`fault`, None once reported): its stream ends with
        an error now and the engine is asked to cancel it. Its slot comes back only once the engine is
        done with it (`release`: a done word, and the terminal status the engine writes before it)."""
        moved = False
        if fault is not None:
            self._bounds.faulted[slot] = True
            generation = int(self._tracked_gen[slot])
            log.error("output channel %d (generation %d): %s; its stream ends with an error",
                      slot, generation, fault)  # fmt: skip
            self.region.store_ctl(slot, "cancel", generation)
            if pending is not None and not pending.terminated:
                pending.terminate(
                    FinishReason.ERROR, f"engine_failure: output channel {slot} is corrupt: {fault}"
                )
                moved = True
        self._delivered[slot] = self.region.load_progress(slot, "count") & (FINAL_BIT - 1)  # quiet the poll
        if release:
            self._release(slot)
            moved = True
        return moved

    def _release(self, slot: int) -> None:
        """The engine is done with the slot: free it (the id stays known until its stream has ended)."""
        self._tracked_gen[slot] = 0
        self._bounds.faulted[slot] = False
        self._areas.release(slot)
        self._free.append(slot)
        self._by_slot.pop(slot, None)

    def _wait_for_payload(
        self,
        pending: Pending,
        slot: int,
        start: int,
        tokens: np.ndarray,
        times: np.ndarray,
        arrived: int,
        final: bool,
    ) -> bool:
        """Deliver the tokens whose stamps are there (not the last one of a final count: it may be the
        terminal's); the slot stays tracked and the next poll reads the rest. A payload that never
        arrives ends the stream with an error instead of a stream of zeros."""
        now = time.monotonic_ns()
        if not pending.payload_wait_since_ns:
            pending.payload_wait_since_ns = now
            self.payload_waits += 1
        ready = max(0, min(arrived, len(tokens) - 1)) if final else arrived
        pending.deliver(tokens, times, ready)
        if pending.terminated:  # a bad logprob row ended it: the engine stops too
            self.region.store_ctl(slot, "cancel", pending.generation)
            return True
        self._delivered[slot] = start + ready
        if ready:
            pending.payload_wait_since_ns = now  # progress: the timeout counts from here
        elif now - pending.payload_wait_since_ns > self.payload_timeout_ns:
            self._delivered[slot] = start + len(tokens)
            self.region.store_ctl(slot, "cancel", pending.generation)  # the engine stops writing it
            missing = f"token {start + arrived}" if arrived < len(tokens) else "finish status"
            pending.terminate(
                FinishReason.ERROR,
                f"engine_failure: the engine published the stream's {missing} but it never arrived "
                f"(waited {self.payload_timeout_ns / 1e9:g} s)",
            )
            return True
        return ready > 0

    def _fail_late(self, now: int) -> None:
        """Requests past their deadline: cancel them in the engine and end their streams now."""
        for pending in self._by_id.values():
            if not pending.terminated and 0 < pending.deadline_ns <= now:
                self.region.store_ctl(pending.slot, "cancel", pending.generation)
                limit = self.request_timeout_ns / 1e9
                pending.terminate(FinishReason.ERROR, f"request timed out after {limit:g} s")

    def _fail_pending(self, error: str) -> None:
        """Engine gone: end every open stream now; the slots come back when an engine finishes them."""
        for pending in self._by_id.values():
            if not pending.terminated:
                self.region.store_ctl(pending.slot, "cancel", pending.generation)
                pending.terminate(FinishReason.ERROR, error)
