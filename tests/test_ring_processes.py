"""Front end and engine in separate processes (multiprocessing spawn) over POSIX shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from blink_appliance.engine.reference.server import EngineServer
from blink_appliance.wire.client import EngineBusyError, EngineClient
from blink_appliance.wire.lifecycle import mark_engine_exited
from blink_appliance.wire.request import FinishReason, Request, SamplingParams
from blink_appliance.wire.ring_layout import EngineState, ErrorCode, RingGeometry
from blink_appliance.wire.shm_transport import ShmTransport
from tests.ring_support import SMALL, VOCAB, CounterEngine, server_thread, shm_region

CTX = mp.get_context("spawn")
WIDE = RingGeometry(
    request_slots=256,
    arena_tokens=1 << 16,
    max_prompt_tokens=128,
    max_inflight=1024,
    max_output_tokens=16,
    max_stop_ids=4,
)


def make_engine(kind: str):
    if kind == "counter":
        return CounterEngine(max_running=64)
    if kind == "counter-slow":
        return CounterEngine(max_running=64, step_delay_s=0.01)
    if kind == "tiny":
        import torch

        from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
        from blink_appliance.model.loaders import build_model, load_checkpoint

        torch.manual_seed(0)
        model = build_model(load_checkpoint("dummy:tiny"), torch.float32, "cpu")
        return LLMEngine(model, EngineConfig())
    raise ValueError(kind)


def engine_main(name: str, geometry: RingGeometry, kind: str) -> None:
    transport = ShmTransport.open(name)
    try:
        EngineServer(make_engine(kind), transport, geometry).run(threading.Event())  # until `shutdown`
    finally:
        transport.close()


@contextlib.contextmanager
def engine_process(name: str, geometry: RingGeometry, kind: str):
    proc = CTX.Process(target=engine_main, args=(name, geometry, kind), daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


async def wait_alive(client: EngineClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.engine_alive:
        assert time.monotonic() < deadline, "engine process did not come up"
        await asyncio.sleep(0.02)


def in_process_reference(kind: str, requests: list[Request]) -> dict[int, list[tuple]]:
    engine = make_engine(kind)
    for request in requests:
        engine.add_request(request)
    out: dict[int, list[tuple]] = defaultdict(list)
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id].append((e.token_id, e.finish_reason, e.error))
    return out


async def thousand_requests(kind: str) -> None:
    rng = np.random.default_rng(1)
    vocab = VOCAB
    prompts = [rng.integers(3, vocab - 1, size=int(rng.integers(1, 100))).tolist() for _ in range(1000)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 9))) for _ in prompts]
    with shm_region(WIDE) as transport, engine_process(transport.name, WIDE, kind) as proc:
        client = EngineClient.attach(transport, WIDE)
        await client.start()
        await wait_alive(client)
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            while True:
                try:
                    ids.append(client.submit(prompt, p))
                    break
                except EngineBusyError:  # the ring (256) is smaller than the burst: wait for the engine
                    await asyncio.sleep(0.001)

        async def collect(rid):
            return [(e.token_id, e.finish_reason, e.error) async for e in client.stream(rid)]

        got = await asyncio.gather(*(collect(rid) for rid in ids))
        telemetry = client.telemetry()
        transport.store_u64(320, 1)  # shutdown word (control block offset 320)
        proc.join(20)
        assert proc.exitcode == 0
        await client.close()
    reference = in_process_reference(
        kind, [Request(rid, prompt, p) for rid, prompt, p in zip(ids, prompts, params, strict=True)]
    )
    for rid, events in zip(ids, got, strict=True):
        assert sum(1 for e in events if e[1] is not None) == 1 and events[-1][1] is not None
        assert events == reference[rid]
    assert telemetry["requests_admitted"] + telemetry["ring_queued"] <= 1000
    assert telemetry["payload_waits"] == 0  # an x86 engine's stores arrive in order: never a wait


async def test_thousand_concurrent_requests_across_processes_match_in_process_engine():
    await thousand_requests("counter")


@pytest.mark.slow
async def test_thousand_concurrent_requests_with_the_reference_engine_on_a_tiny_model():
    pytest.importorskip("blink_appliance.engine.reference.engine", reason="reference engine not built yet")
    await thousand_requests("tiny")


async def _open_streams(client: EngineClient, n: int, max_tokens: int) -> list:
    ids = [client.submit([7, 8], SamplingParams(max_tokens=max_tokens)) for _ in range(n)]
    streams = [client.stream(rid) for rid in ids]
    for s in streams:
        await s.__anext__()  # every request is being generated
    return streams


async def _last_events(streams: list) -> list:
    ends = []
    for s in streams:
        async for event in s:
            last = event
        ends.append(last)
    return ends


async def test_engine_exit_marked_by_its_supervisor_fails_streams_at_once_and_a_restarted_engine_serves():
    """The daemon's verdict (mark_engine_exited on waitpid), not the heartbeat, ends a dead engine's
    streams: within a second of the mark, long before the stall limit."""
    with shm_region(SMALL) as transport:
        client = EngineClient.attach(transport, SMALL)
        await client.start()
        with engine_process(transport.name, SMALL, "counter-slow") as proc:
            await wait_alive(client)
            streams = await _open_streams(client, 10, 60)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            mark_engine_exited(client.region)
            marked = time.monotonic()
            ends = await _last_events(streams)
            assert time.monotonic() - marked < 1.0
        for event in ends:
            assert event.finish_reason is FinishReason.ERROR and "engine state FAILED" in event.error
        assert not client.engine_alive

        with engine_process(transport.name, SMALL, "counter") as proc:
            await wait_alive(client)
            events = [e async for e in client.stream(client.submit([7, 8], SamplingParams(max_tokens=3)))]
            assert [e.finish_reason for e in events] == [None, None, FinishReason.LENGTH]
            deadline = time.monotonic() + 5
            while len(client._free) < SMALL.max_inflight:  # the dead epoch's slots were recovered
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert transport.load_u64(200) == 2  # engine_epoch
            transport.store_u64(320, 1)
            proc.join(20)
            assert transport.load_u64(208) == EngineState.STOPPED
            mark_engine_exited(client.region)  # a clean stop stays STOPPED
            assert transport.load_u64(208) == EngineState.STOPPED
        await client.close()


@contextlib.asynccontextmanager
async def slow_engine_and_client(**options):
    """A started client and a live "counter-slow" engine process on a fresh region."""
    with shm_region(SMALL) as transport:
        client = EngineClient.attach(transport, SMALL, **options)
        await client.start()
        try:
            with engine_process(transport.name, SMALL, "counter-slow") as proc:
                await wait_alive(client)
                yield client, proc
        finally:
            await client.close()


async def test_an_engine_stopped_for_longer_than_the_old_heartbeat_limit_loses_no_stream():
    """SIGSTOP for 1.5 s (a host under load, a debugger): the streams wait and then finish."""
    async with slow_engine_and_client() as (client, proc):
        streams = await _open_streams(client, 6, 20)
        os.kill(proc.pid, signal.SIGSTOP)
        await asyncio.sleep(1.5)
        os.kill(proc.pid, signal.SIGCONT)
        ends = await _last_events(streams)
    assert [e.finish_reason for e in ends] == [FinishReason.LENGTH] * 6, [e.error for e in ends]


async def test_an_engine_stuck_past_the_stall_limit_fails_its_streams():
    async with slow_engine_and_client(stall_limit_s=0.5) as (client, proc):
        streams = await _open_streams(client, 3, 60)
        os.kill(proc.pid, signal.SIGSTOP)
        ends = await asyncio.wait_for(_last_events(streams), 30)
        os.kill(proc.pid, signal.SIGKILL)
    for event in ends:
        assert event.finish_reason is FinishReason.ERROR and "heartbeat last advanced" in event.error


def frontend_main(name: str, geometry: RingGeometry, ready) -> None:
    async def main() -> None:
        client = EngineClient.attach(ShmTransport.open(name), geometry)
        await client.start()
        while len(client._by_slot) < geometry.max_inflight:
            try:
                client.submit([5, 6], SamplingParams(max_tokens=64, ignore_eos=True))
            except EngineBusyError:  # ring (16) smaller than the slots (32): let the engine drain it
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        ready.set()
        await asyncio.sleep(3600)

    asyncio.run(main())


async def test_frontend_death_mid_stream_is_reclaimed_by_the_engine():
    engine = CounterEngine(max_running=4, step_delay_s=0.02)  # nobody finishes before the reclaim
    geometry = SMALL
    with (
        shm_region(geometry) as transport,
        server_thread(engine, transport, geometry, frontend_timeout_s=0.5) as srv,
    ):
        ready = CTX.Event()
        proc = CTX.Process(target=frontend_main, args=(transport.name, geometry, ready), daemon=True)
        proc.start()
        assert ready.wait(60)
        assert engine.steps > 0 and srv._live
        proc.kill()
        proc.join(10)
        deadline = time.monotonic() + 5
        while srv._live or srv._tail < transport.load_u64(64):
            assert time.monotonic() < deadline, "engine did not reclaim the dead front end's requests"
            await asyncio.sleep(0.02)
        assert not engine.has_unfinished()
        for slot in range(geometry.max_inflight):
            status = srv.region.read_status(slot)
            assert srv.region.load_progress(slot, "done") == srv.region.load_ctl(slot, "generation") == 1
            assert int(status["error_code"]) == ErrorCode.FRONTEND_LOST
        # A new front end gets every slot back and is served.
        client = EngineClient.attach(transport, geometry)
        await client.start()
        assert len(client._free) == geometry.max_inflight
        events = [e async for e in client.stream(client.submit([1, 2], SamplingParams(max_tokens=2)))]
        assert events[-1].finish_reason is FinishReason.LENGTH
        await client.close()


def _spin(stop) -> None:
    while not stop.is_set():
        pass


async def test_streams_finish_while_every_core_is_busy():
    """A busy process on every core (what real neighbours do): no false engine death, no lost stream."""
    stop = CTX.Event()
    hogs = [CTX.Process(target=_spin, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    async with slow_engine_and_client() as (client, _):
        for hog in hogs:
            hog.start()
        try:
            streams = await _open_streams(client, 8, 30)
            ends = await asyncio.wait_for(_last_events(streams), 120)
        finally:
            stop.set()
            for hog in hogs:
                hog.join(10)
    assert [e.finish_reason for e in ends] == [FinishReason.LENGTH] * 8, [e.error for e in ends]
