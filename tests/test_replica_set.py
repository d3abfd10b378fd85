"""A model's replicas behind one client (frontend/replicas.py): requests go to the live replica with
the fewest outstanding tokens; streams, cancels and telemetry reach the right engine."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from blink_appliance.frontend.replicas import ReplicaSet

from blink_appliance.wire.errors import EngineBusyError
from blink_appliance.wire.request import FinishReason, SamplingParams, TokenEvent, TokenRun
from tests.ring_support import SMALL, CounterEngine, client_for, expected_token, server_thread, shm_region


class FakeClient:
    """An engine client whose streams the test feeds by hand."""

    def __init__(self, alive: bool = True, busy: bool = False) -> None:
        self.engine_alive, self.busy = alive, busy
        self.submitted: list[tuple[list[int], int]] = []
        self.queues: dict[int, asyncio.Queue[list[TokenEvent]]] = {}
        self.closed: list[int] = []  # streams that ended, fully read or left early
        self.abandoned: list[int] = []

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        if self.busy:
            raise EngineBusyError("full")
        self.submitted.append((prompt_ids, params.max_tokens))
        rid = 100 + len(self.submitted)
        self.queues[rid] = asyncio.Queue()
        return rid

    async def stream_batches(self, request_id: int, whole: bool = False):
        try:
            while True:
                batch = await self.queues[request_id].get()
                yield batch
                if batch[-1].finished:
                    return
        finally:
            self.closed.append(request_id)

    def abandon(self, request_id: int) -> None:
        self.abandoned.append(request_id)

    def telemetry(self) -> dict[str, int]:
        return {"running": len(self.queues), "kv_blocks_total": 10, "engine_alive": int(self.engine_alive),
                "updated_ns": 5 + len(self.submitted), "engine_epoch": 3}  # fmt: skip


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def test_a_whole_responses_token_run_comes_off_its_replicas_count_token_by_token():
    """A whole response's tokens come as one TokenRun: each of them still counts as done."""
    a, b = FakeClient(), FakeClient()
    replicas = ReplicaSet([a, b])
    rid = await replicas.submit([1] * 4, params(100))  # a: 104
    a.queues[101].put_nowait([TokenRun(101, [5, 6, 7], [1, 2, 3]), TokenEvent(101, 8)])
    stream = replicas.stream_batches(rid, whole=True)
    await anext(stream)
    assert replicas.outstanding == [100, 0]
    await stream.aclose()


async def test_requests_go_to_the_replica_with_the_fewest_outstanding_tokens():
    a, b = FakeClient(), FakeClient()
    replicas = ReplicaSet([a, b])
    big = await replicas.submit([1] * 10, params(100))  # a: 110
    small = await replicas.submit([1] * 10, params(10))  # b: 20
    third = await replicas.submit([1], params(10))  # b: 31
    assert [len(a.submitted), len(b.submitted)] == [1, 2] and replicas.outstanding == [110, 31]
    # Tokens that stream back come off their replica's count; the end takes off the rest.
    rid_a = 101
    a.queues[rid_a].put_nowait([TokenEvent(rid_a, 7), TokenEvent(rid_a, 8)])
    a.queues[rid_a].put_nowait([TokenEvent(rid_a, 9, FinishReason.LENGTH)])
    stream = replicas.stream_batches(big)
    assert [e.token_id for e in await anext(stream)] == [7, 8] and replicas.outstanding == [108, 31]
    assert [b async for b in stream][-1][-1].finish_reason is FinishReason.LENGTH
    assert replicas.outstanding == [0, 31]
    fourth = await replicas.submit([1], params(5))
    assert len(a.submitted) == 2
    # Abandoning reaches the replica that holds the request, under its own id there; leaving a
    # stream early cancels it through that replica's stream.
    replicas.abandon(third)
    replicas.abandon(fourth)
    assert b.abandoned == [102] and a.abandoned == [102] and replicas.outstanding == [0, 20]
    b.queues[101].put_nowait([TokenEvent(101, 1)])
    stream = replicas.stream_batches(small)
    await anext(stream)
    await stream.aclose()
    assert b.closed == [101] and replicas.outstanding == [0, 0]


async def test_a_dead_replica_gets_no_requests_and_a_full_one_passes_them_on():
    dead, full, live = FakeClient(alive=False), FakeClient(busy=True), FakeClient()
    replicas = ReplicaSet([dead, full, live])
    for _ in range(3):
        await replicas.submit([1], params(1))
    assert not dead.submitted and not full.submitted and len(live.submitted) == 3
    assert replicas.engine_alive
    live.busy = True
    with pytest.raises(EngineBusyError):
        await replicas.submit([1], params(1))
    assert not ReplicaSet([FakeClient(alive=False)]).engine_alive


def test_telemetry_sums_the_replicas_and_is_alive_only_while_all_are():
    a, b = FakeClient(), FakeClient(alive=False)
    a.submitted.append(([1], 1))
    t = ReplicaSet([a, b]).telemetry()
    assert t["kv_blocks_total"] == 20 and t["updated_ns"] == 6 and t["engine_epoch"] == 3
    assert t["engine_alive"] == 0


async def test_two_engines_behind_one_replica_set_serve_every_request_whole():
    """Real rings: two CounterEngine servers, one ReplicaSet over their clients."""
    geometry = dataclasses.replace(SMALL, request_slots=32)
    engines = [CounterEngine(max_running=32), CounterEngine(max_running=32)]
    with shm_region(geometry) as t0, shm_region(geometry) as t1:
        with server_thread(engines[0], t0, geometry), server_thread(engines[1], t1, geometry):
            async with client_for(t0, geometry) as c0, client_for(t1, geometry) as c1:
                replicas = ReplicaSet([c0, c1])
                ids = [
                    await replicas.submit([3, k], SamplingParams(max_tokens=16, ignore_eos=True))
                    for k in range(12)
                ]

                async def tokens(rid: int) -> list[int]:
                    return [e.token_id for b in [b async for b in replicas.stream_batches(rid)] for e in b]

                got = await asyncio.gather(*(tokens(rid) for rid in ids))
    assert got == [[expected_token([3, k], i) for i in range(16)] for k in range(12)]
    assert len(engines[0].added) == len(engines[1].added) == 6
    assert replicas.outstanding == [0, 0]
