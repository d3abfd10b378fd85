"""Shared pieces of the ring tests (no tests here): a small deterministic engine with the LLMEngine
API, region/transport fixtures, helpers that run a ring server (either engine's) in a thread, and a
started client for it (or for a test that plays the engine by hand)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import make_dataclass
from typing import Any, Protocol

from blink_appliance.engine.reference.server import EngineServer
from blink_appliance.wire.client import EngineBusyError, EngineClient
from blink_appliance.wire.lifecycle import Heartbeat
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason, Request, SamplingParams, TokenEvent, TokenLogprobs
from blink_appliance.wire.ring_layout import (
    OCCUPANCY_FIELDS,
    STEP_COUNTER_FIELDS,
    EngineState,
    RingGeometry,
    region_size,
)
from blink_appliance.wire.shm_transport import ShmTransport

EOS = 2
VOCAB = 512
SMALL = RingGeometry(
    request_slots=16,
    arena_tokens=4096,
    max_prompt_tokens=256,
    max_inflight=32,
    max_output_tokens=64,
    max_stop_ids=4,
)


# What LLMEngine.stats() returns (EngineStats: the wire's occupancy gauges and step counters),
# without importing the reference engine and with it the model's torch.
CounterStats = make_dataclass(
    "CounterStats", [(name, int) for name in (*OCCUPANCY_FIELDS, *STEP_COUNTER_FIELDS)]
)


def expected_token(prompt: list[int], index: int) -> int:
    """CounterEngine's i-th output for `prompt` (never EOS unless the arithmetic lands there)."""
    return (sum(prompt) * 31 + 7 * index + len(prompt)) % VOCAB


class CounterEngine:
    """Deterministic stand-in with the LLMEngine API: one token per running request per step,
    `blocks_per_request` pretend KV blocks held while running, at most `max_running` at once."""

    def __init__(self, max_running: int = 8, blocks_per_request: int = 2, step_delay_s: float = 0.0) -> None:
        self.vocab_size = VOCAB
        self.max_running = max_running
        self.blocks_per_request = blocks_per_request
        self.step_delay_s = step_delay_s
        self.waiting: list[Request] = []
        self.running: dict[int, tuple[Request, int]] = {}
        self.steps = 0
        self.generated = 0
        self.added: list[int] = []
        self.aborted: list[int] = []

    def add_request(self, request: Request) -> None:
        if request.prompt_token_ids and request.prompt_token_ids[0] == VOCAB - 1:
            raise ValueError("CounterEngine refuses prompts starting with the last vocab id")
        self.added.append(request.request_id)
        self.waiting.append(request)

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[TokenEvent]:
        if self.step_delay_s:
            threading.Event().wait(self.step_delay_s)
        self.waiting.sort(key=lambda r: r.priority)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.pop(0)
            self.running[req.request_id] = (req, 0)
        self.steps += 1
        events = []
        for rid, (req, n) in list(self.running.items()):
            tok = expected_token(req.prompt_token_ids, n)
            n += 1
            self.generated += 1
            reason = None
            if tok in req.params.stop_token_ids or (tok == EOS and not req.params.ignore_eos):
                reason = FinishReason.STOP
            elif n >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            events.append(TokenEvent(rid, tok, reason, None, 0, *counter_logprobs(req, n - 1, tok)))
            if reason is None:
                self.running[rid] = (req, n)
            else:
                del self.running[rid]
        return events

    def stats(self) -> Any:  # a CounterStats
        used = self.blocks_per_request * len(self.running)
        return CounterStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_blocks_used=used,
            kv_blocks_total=1000,
            kv_blocks_cached=0,
            steps=self.steps,
            generated_tokens=self.generated,
            preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
        )


def _row(token: int, value: float, top_n: int) -> TokenLogprobs:
    """A made-up row whose values an f32 holds exactly, so the ring's round trip can be checked exactly."""
    return TokenLogprobs(token, value, tuple(((token + j + 1) % VOCAB, value - j - 1) for j in range(top_n)))


def counter_logprobs(req: Request, index: int, token: int) -> tuple[TokenLogprobs | None, tuple | None]:
    """CounterEngine's logprobs for output `index` (and the prompt's, with the first), when asked."""
    n = req.params.logprobs
    if n is None:
        return None, None
    prompt = None
    if req.params.prompt_logprobs and index == 0:
        ids = req.prompt_token_ids
        prompt = tuple(_row(ids[p], -p / 4, n) for p in range(1, len(ids)))
    return _row(token, -(index + 1) / 8, n), prompt


def expected_events(prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    out = []
    for i in range(max_tokens):
        tok = expected_token(prompt, i)
        out.append(tok)
        if tok in stop_ids or tok == EOS:
            break
    return out


def unique_name() -> str:
    return f"blink-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def shm_region(geometry: RingGeometry = SMALL, name: str | None = None):
    """A fresh region for `geometry`, under `name` (default: a unique one)."""
    transport = ShmTransport.create(name or unique_name(), region_size(geometry))
    try:
        RingRegion.create(transport, geometry)
        yield transport
    finally:
        transport.close()


class RingServer(Protocol):
    def run(self, stop: threading.Event) -> None: ...


def serve_in_thread(
    server: RingServer, stop: threading.Event
) -> tuple[threading.Thread, list[BaseException]]:
    """Run `server` until `stop` in a daemon thread; what it raised lands in the returned list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(stop)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


async def wait_until_async(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """wait_until for a test on the event loop: it yields, so the client's pump runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def server_thread(engine, transport, geometry: RingGeometry = SMALL, **options):
    server = EngineServer(engine, transport, geometry, **options)
    stop = threading.Event()
    thread, errors = serve_in_thread(server, stop)
    # Hand the server over only once it runs: a client attaching earlier waits just a moment for a
    # heartbeat, and on a loaded CI machine thread start-up can take longer than that.
    deadline = time.monotonic() + 10
    while server.region.load("engine_state") != EngineState.RUNNING and not errors:
        assert thread.is_alive() and time.monotonic() < deadline, "engine server did not start"
        time.sleep(0.005)
    try:
        yield server
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "engine server did not stop"
        assert not errors, errors


@contextlib.asynccontextmanager
async def client_for(transport, geometry: RingGeometry = SMALL, **options):
    """A started EngineClient on `transport` that has seen the engine's heartbeat; closed after."""
    client = EngineClient.attach(transport, geometry, **options)
    await client.start()
    # A client counts the engine alive once it has seen the heartbeat advance. start() waits 0.25 s
    # for that; on a loaded 2-core CI machine the engine's heartbeat thread can miss it (a first
    # submit then raised EngineDeadError). Every server here is running, so wait for the beat.
    deadline = time.monotonic() + 10
    try:
        while not client.engine_alive:
            assert time.monotonic() < deadline, "no engine heartbeat within 10 s"
            await asyncio.sleep(0.005)
        yield client
    finally:
        await client.close()


async def collect(client: EngineClient, request_id: int):
    """Every event of one request's stream, its terminal one last."""
    return [event async for event in client.stream(request_id)]


async def submit_when_free(
    client: EngineClient, prompt: list[int], params: SamplingParams, timeout: float = 60.0
) -> int:
    """Submit, retrying while the engine is busy (ring, arena or slots full) for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.submit(prompt, params)
        except EngineBusyError as busy:
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
            await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def hand_engine_client(**options):
    """(client, region) on a fresh region whose engine is the test itself: RUNNING and a heartbeat,
    nobody reading the ring, so the test writes the engine's words by hand."""
    with shm_region() as transport:
        region = RingRegion.attach(transport, SMALL)
        region.store("engine_state", EngineState.RUNNING)
        heartbeat = Heartbeat(region, interval_s=0.01)
        heartbeat.start()
        try:
            async with client_for(transport, stall_limit_s=60.0, **options) as client:
                yield client, region
        finally:
            heartbeat.stop()


class RawProducer:
    """Writes request records straight through the layout module, the way a (possibly buggy)
    front end would, so tests can publish records EngineClient would never build."""

    def __init__(self, region: RingRegion) -> None:
        self.region = region
        self.head = region.load("req_head")
        self.arena_head = region.load("arena_head")
        self.next_slot = 0

    def publish(
        self, prompt: list[int], *, overrides: dict | None = None, claim: bool = True
    ) -> tuple[int, int]:
        """Claim the next slot (as a front end would), write prompt + record; returns (slot, generation)."""
        import numpy as np

        r, g = self.region, self.region.geometry
        slot = self.next_slot % g.max_inflight
        self.next_slot += 1
        generation = r.load_ctl(slot, "generation") + 1
        if claim:
            r.store_progress(slot, "count", 0)
            r.clear_status(slot)
            r.store_ctl(slot, "generation", generation)
        position = self.arena_head
        if position % g.arena_tokens + len(prompt) > g.arena_tokens:
            position += g.arena_tokens - position % g.arena_tokens
        r.write_prompt(position, np.asarray(prompt, dtype="<i4"))
        self.arena_head = position + len(prompt)
        r.store("arena_head", self.arena_head)
        record = r.new_record()
        rec = record[0]
        rec["request_id"], rec["generation"], rec["slot"] = 1000 + self.head, generation, slot
        rec["prompt_offset"], rec["arena_end"], rec["prompt_len"] = position, self.arena_head, len(prompt)
        rec["max_tokens"], rec["temperature"], rec["top_p"] = 4, 0.0, 1.0
        for name, value in (overrides or {}).items():
            rec[name] = value
        r.publish_record(self.head, record)
        self.head += 1
        r.doorbell("req_head", self.head)
        return slot, generation
