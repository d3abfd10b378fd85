"""Front-end side of the rings: submit requests, stream their tokens, cancel, watch the engine.

Used by the aiohttp front end. `submit` and `cancel` are plain calls (a few stores into the
region); one pump task on the event loop polls every open channel, feeds per-request queues and
writes the front end's heartbeat (channel_pump.py). Single producer: one EngineClient per region.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from blink_appliance.wire.channel_pump import ChannelPump
from blink_appliance.wire.channels import ChannelBounds, Pending
from blink_appliance.wire.engine_watch import ENGINE_STALL_LIMIT_S, EngineWatch
from blink_appliance.wire.errors import EngineBusyError, EngineDeadError
from blink_appliance.wire.prefix_hash import arena_words
from blink_appliance.wire.region import RingRegion, checked_submission
from blink_appliance.wire.request import FinishReason, OutputEvent, SamplingParams, TokenEvent
from blink_appliance.wire.request_areas import RequestAreas
from blink_appliance.wire.ring_cursor import RingCursor
from blink_appliance.wire.ring_layout import RingGeometry
from blink_appliance.wire.transport import Transport

log = logging.getLogger(__name__)

# Request ids, generations and epochs wrap below these instead of overflowing their u64 words: a word
# overwritten with a value near 2**64 must not make every later store raise.
REQUEST_ID_LIMIT = 2**63
U64_MAX = 2**64 - 1


class EngineClient(ChannelPump):
    def __init__(
        self,
        region: RingRegion,
        *,
        stall_limit_s: float = ENGINE_STALL_LIMIT_S,
        request_timeout_s: float = 0.0,
        poll_interval_s: float = 0.0005,
        spin_s: float = 0.0005,
        payload_timeout_s: float = 1.0,
        ring_repair_limit_s: float = ENGINE_STALL_LIMIT_S,
        control_interval_s: float = 0.0,
    ) -> None:
        self.region = region
        self.geometry = region.geometry
        self._watch = EngineWatch(stall_limit_s)
        # A request not finished this long after its submit is cancelled and ends with an error
        # event (0: no limit); checked by the pump every TIMEOUT_CHECK_NS.
        self.request_timeout_ns = int(request_timeout_s * 1e9)
        self._timeouts_checked_ns = 0
        self.poll_interval_s = poll_interval_s
        # How often the pump writes our heartbeat and reads the engine's (0: every pass). Over a
        # network link each is a round trip, and the limits they serve are seconds.
        self.control_interval_ns = int(control_interval_s * 1e9)
        self._control_checked_ns = 0
        self._alive = False  # engine_alive at the last check
        self._lost: str | None = None  # why the transport's link failed (remote_client.py; None: it works)
        # After activity, poll without sleeping this long: asyncio sleeps round up to 1 ms.
        self.spin_ns = int(spin_s * 1e9)
        # A count may be seen before the token and stamp it covers have arrived (a weakly ordered
        # writer; seen once on the H100): wait this long for them, then fail the stream.
        self.payload_timeout_ns = int(payload_timeout_s * 1e9)
        self.payload_waits = 0  # waits begun so (telemetry: any is an engine write-ordering bug)
        self._active_ns = 0  # last submit or delivered event
        self._nap_future: asyncio.Future[None] | None = None
        n = self.geometry.max_inflight
        self._tracked_gen = np.zeros(n, dtype=np.uint64)  # generation we wait on per slot; 0 = free
        self._delivered = np.zeros(n, dtype=np.uint64)  # tokens read from each slot
        self._whole = np.zeros(n, dtype=bool)  # the slot's response is sent whole (read in batches)
        self._bounds = ChannelBounds(n)  # what each tracked channel's words may hold
        self._by_slot: dict[int, Pending] = {}
        self._by_id: dict[int, Pending] = {}
        self._free: deque[int] = deque()
        self._areas = RequestAreas(self.geometry)
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self._ring_repair_limit_s = ring_repair_limit_s
        self._ring = RingCursor(region, ring_repair_limit_s)
        self._next_id = 0

    @classmethod
    def attach(cls, transport: Transport, geometry: RingGeometry, **options: float) -> EngineClient:
        return cls(RingRegion.attach(transport, geometry), **options)

    # -- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the producer role and start the pump on the running loop."""
        if self._pump is not None:
            raise RuntimeError("EngineClient already started")
        self._take_region()
        self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name="engine-client-pump")
        # Give a live engine a moment to show a heartbeat, so the first submit does not see it dead.
        deadline = time.monotonic() + 0.25
        while not self.engine_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def _take_region(self) -> None:
        """Take the producer role on the region: our epoch and heads, and the free slots."""
        r = self.region
        r.store("frontend_epoch", r.load("frontend_epoch") % U64_MAX + 1)
        r.store("frontend_pid", os.getpid())
        r.store("frontend_heartbeat_ns", time.monotonic_ns())
        self._ring.take_heads()
        self._next_id = r.load("next_request_id") % REQUEST_ID_LIMIT or 1
        # A slot is ours again once the engine finished its last generation. Slots a previous
        # front end left open have no client any more: cancel them (the engine would otherwise
        # generate them to the end, or wait for its front-end timeout), and track them until done.
        ctl, prog = r.ctl_table(), r.progress_table()
        for slot in range(self.geometry.max_inflight):
            gen, done = int(ctl["generation"][slot]), int(prog["done"][slot])
            if gen == done or gen == 0:  # generation 0 was never claimed, whatever its done word reads
                self._free.append(slot)
            else:
                self._tracked_gen[slot] = gen
                self._bounds.claim(slot, done, self.geometry.max_output_tokens)
                r.store_ctl(slot, "cancel", gen)
        self._areas.adopt({s for s in range(self.geometry.max_inflight) if self._tracked_gen[s]})
        self._watch.restart(r)

    async def close(self) -> None:
        """Cancel what is in flight (the engine frees it) and end every open stream."""
        if self._closed:
            return
        self._closed = True
        for pending in list(self._by_id.values()):
            self.cancel(pending.request_id)
            pending.terminate(FinishReason.ABORT, "client closed")
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        """Publish one request; returns its id. Never blocks: a full ring raises EngineBusyError."""
        if self._pump is None or self._closed:
            raise RuntimeError("EngineClient is not started (await start()) or already closed")
        prompt = checked_submission(prompt_token_ids, params, priority, self.geometry)
        if not self.engine_alive:
            raise EngineDeadError(f"engine is not running ({self._why_dead()})")
        return self._publish(prompt, params, priority)

    def _publish(self, prompt: np.ndarray, params: SamplingParams, priority: int) -> int:
        g = self.geometry
        r = self.region
        ring = self._ring
        tails = ring.check(time.monotonic_ns())
        if tails is None:
            raise EngineBusyError(
                "the ring's tail words contradict our heads; the engine is putting them back"
            )
        tail, arena_tail = tails
        if not self._free:
            raise EngineBusyError(f"all {g.max_inflight} in-flight slots are taken")
        if ring.head - tail >= g.request_slots:
            raise EngineBusyError(f"request ring full ({g.request_slots} records queued)")
        n = int(prompt.size)
        words = arena_words(prompt, g.prefix_block_size)  # the prompt, then its block hashes if any
        position = ring.arena_head
        if position % g.arena_tokens + words.size > g.arena_tokens:
            position += g.arena_tokens - position % g.arena_tokens  # keep the prompt contiguous
        end = position + words.size
        if end - arena_tail > g.arena_tokens:
            raise EngineBusyError("prompt token arena full")
        # The record is built before anything is claimed: a field that does not fit its ring word
        # (top_k 2**31, say) must fail here, not after the slot is taken, or the slot is lost for good.
        request_id = self._next_id
        try:
            record = r.request_record((request_id, 0, 0, priority), (position, end, n), params)
        except OverflowError as e:
            raise ValueError(f"a sampling parameter does not fit the request record: {e}") from None

        slot = self._free[0]
        stream = self._areas.open(r, slot, params, n, record)  # raises EngineBusyError when full
        self._free.popleft()
        generation = int(r.load_ctl(slot, "generation")) % U64_MAX + 1
        done = r.load_progress(slot, "done")
        if generation == done:  # an overwritten done word would end the request at once
            generation = generation % U64_MAX + 1
        self._bounds.claim(slot, done, params.max_tokens)
        self._next_id = self._next_id % (REQUEST_ID_LIMIT - 1) + 1
        # The slot is ours (done == previous generation): reset it, then claim the new generation.
        # All of it is the record's payload: the engine reads none of it before the seq word.
        with r.transport.batch():
            r.store_progress(slot, "count", 0)
            r.clear_status(slot)
            r.clear_stamps(slot, params.max_tokens)  # 0 marks a token not yet written (see _drain_slot)
            r.store_ctl(slot, "request_id", request_id)
            r.store_ctl(slot, "generation", generation)
            r.write_prompt(position, words)
            ring.arena_head = end
            r.store("arena_head", end)
            record[0]["generation"], record[0]["slot"] = generation, slot
            r.write_record(ring.head, record)
            r.store("next_request_id", self._next_id)
        r.publish_seq(ring.head)
        ring.head += 1
        r.doorbell("req_head", ring.head)

        self._active_ns = time.monotonic_ns()
        self._wake()  # the pump spins again while this request is young
        deadline = time.monotonic_ns() + self.request_timeout_ns if self.request_timeout_ns else 0
        pending = Pending(request_id, slot, generation, deadline_ns=deadline, logprobs=stream)
        self._by_id[request_id] = self._by_slot[slot] = pending
        self._tracked_gen[slot], self._delivered[slot], self._whole[slot] = generation, 0, False
        return request_id

    async def stream(self, request_id: int) -> AsyncIterator[TokenEvent]:
        """The request's events, ending with its terminal one. Leaving early cancels the request
        (use contextlib.aclosing for a prompt cancel on `break`)."""
        async with contextlib.aclosing(self.stream_batches(request_id)) as batches:
            async for batch in batches:
                for event in batch:
                    assert isinstance(event, TokenEvent)  # runs come only to a stream opened `whole`
                    yield event

    async def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[OutputEvent]]:
        """The request's events as they arrived, a list per wake-up, the last ending with the terminal
        event. `whole`: after the first tokens, the rest come HELD_TOKENS or more at a time, a TokenRun
        per read unless it asked for logprobs (channels.resting). Leaving early cancels the request."""
        pending = self._by_id.get(request_id)
        if pending is None:
            raise KeyError(f"unknown or already finished request id {request_id}")
        self._whole[pending.slot] = whole
        pending.runs = whole and pending.logprobs is None
        finished = False
        try:
            while True:
                batch = [await pending.queue.get()]
                while not batch[-1].finished and not pending.queue.empty():
                    batch.append(pending.queue.get_nowait())
                finished = batch[-1].finished
                yield batch
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)
            self._by_id.pop(request_id, None)

    def abandon(self, request_id: int) -> None:
        """Cancel a request whose stream was never opened, and forget it: its events go nowhere."""
        self.cancel(request_id)
        self._by_id.pop(request_id, None)

    def cancel(self, request_id: int) -> None:
        """Ask the engine to abort; the stream still ends with an ABORT terminal event."""
        pending = self._by_id.get(request_id)
        if pending is not None and self._by_slot.get(pending.slot) is pending:  # slot not yet reused
            self.region.store_ctl(pending.slot, "cancel", pending.generation)

    # -- engine liveness and telemetry -------------------------------------------------------------
    @property
    def engine_alive(self) -> bool:
        """The engine's state and heartbeat say it serves (engine_watch.py)."""
        return self._watch.alive(self.region)

    def _why_dead(self) -> str:
        """Why `engine_alive` is false, for the error a caller sees."""
        return self._watch.why_dead(self.region)

    def telemetry(self) -> dict[str, int | float]:
        r = self.region
        # An odd sequence word with no live engine to finish the write (one died mid-write, or the
        # word was overwritten) will not change: one try, not a second of this event loop.
        values: dict[str, int | float] = dict(r.read_telemetry(1.0 if self.engine_alive else 0.0))
        values.update(
            engine_alive=int(self.engine_alive),
            engine_epoch=r.load("engine_epoch"),
            engine_state=r.load("engine_state"),
            ring_queued=self._ring.head - r.load("req_tail"),
            ring_capacity=self.geometry.request_slots,
            inflight=len(self._by_slot),
            inflight_capacity=self.geometry.max_inflight,
            arena_used=self._ring.arena_head - r.load("arena_tail"),
            arena_capacity=self.geometry.arena_tokens,
            payload_waits=self.payload_waits,
            foreign_records=self._ring.foreign_records,
            ring_faults=self._ring.faults,
            channel_faults=self._bounds.faults,
        )
        return values
