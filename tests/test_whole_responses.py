"""Responses sent whole (EngineClient.stream_batches with `whole`): their reader is not woken for
every engine step, only for the first tokens, every HELD_TOKENS tokens and the end."""

from __future__ import annotations

import numpy as np

from blink_appliance.wire.channels import HELD_TOKENS, Pending
from blink_appliance.wire.request import FinishReason, SamplingParams
from tests.ring_support import CounterEngine, client_for, server_thread, shm_region, wait_until_async


async def test_a_whole_response_wakes_its_reader_for_the_first_tokens_and_the_end_only():
    """stream_batches(whole=True): once the first tokens are read, the rest wait out of the queue
    (no wake-up per step for a response sent whole) and come in one list with the terminal."""
    engine = CounterEngine(step_delay_s=0.03)
    with shm_region() as transport, server_thread(engine, transport):
        async with client_for(transport) as client:
            rid = client.submit([5, 6], SamplingParams(max_tokens=64))  # 2 s of steps
            batches = client.stream_batches(rid, whole=True)
            first = await anext(batches)
            pending = client._by_id[rid]
            await wait_until_async(lambda: engine.generated >= len(first) + 5, "more tokens to be made")
            await wait_until_async(lambda: len(pending.held) >= 5, "the client to read them")
            assert pending.queue.empty(), "a whole response's reader was woken for every step"
            rest = [batch async for batch in batches]
    assert len(rest) == 1 and rest[0][-1].finish_reason is FinishReason.LENGTH
    assert sum(e.token_id is not None for e in first + rest[0]) == 64


def test_a_deferred_reader_wakes_every_held_tokens_tokens():
    """A whole response's tokens reach its reader HELD_TOKENS at a time after the first ones, so
    its text is made while the engine still decodes, not all at its end."""
    pending = Pending(1, slot=0, generation=1, defer=True)
    one = np.ones(1, dtype=np.int64)
    pending.deliver(one, one, 1)
    assert pending.queue.qsize() == 1  # the first tokens wake it
    for _ in range(HELD_TOKENS - 1):
        pending.deliver(one, one, 1)
    assert pending.queue.qsize() == 1 and len(pending.held) == HELD_TOKENS - 1
    pending.deliver(one, one, 1)
    assert pending.queue.qsize() == 1 + HELD_TOKENS and not pending.held
