"""Responses sent whole (EngineClient.stream_batches with `whole`): after the first tokens, the pump
leaves their channels unread until HELD_TOKENS tokens wait there or the request ends, so a batch of
them costs the front end no work per engine step; and what it reads comes as one TokenRun, not an
event per token."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from blink_appliance.wire.channels import HELD_TOKENS, WHOLE_READS_PER_PASS, spread
from blink_appliance.wire.request import FinishReason, OutputEvent, SamplingParams, TokenEvent, TokenRun
from tests.ring_support import (
    SMALL,
    CounterEngine,
    client_for,
    expected_token,
    server_thread,
    shm_region,
    wait_until_async,
)

LONG = dataclasses.replace(SMALL, request_slots=32, max_output_tokens=512, logprob_pairs=1 << 14)


def tokens_of(batch: list[OutputEvent]) -> list[int]:
    return [token for event in batch for token in event.token_ids]


async def test_a_whole_response_is_read_from_its_channel_every_held_tokens_tokens():
    """The pump reads a whole response's channel for its first tokens, then only once HELD_TOKENS
    more wait there (the tokens stay in the channel meanwhile), and at its end."""
    engine = CounterEngine(step_delay_s=0.002)
    max_tokens = 2 * HELD_TOKENS + 40
    with shm_region(LONG) as transport, server_thread(engine, transport, LONG):
        async with client_for(transport, LONG) as client:
            rid = client.submit([5, 6], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            slot = client._by_id[rid].slot
            batches = client.stream_batches(rid, whole=True)
            first = await anext(batches)
            read = int(client._delivered[slot])
            await wait_until_async(lambda: engine.generated >= read + HELD_TOKENS // 2, "more tokens")
            assert int(client._delivered[slot]) == read, "the pump read a whole response every step"
            rest = [batch async for batch in batches]
    assert rest[-1][-1].finish_reason is FinishReason.LENGTH
    assert all(len(tokens_of(batch)) >= HELD_TOKENS for batch in rest[:-1]), [len(tokens_of(b)) for b in rest]
    assert 1 <= len(rest) <= max_tokens // HELD_TOKENS + 1
    # One object per read, whatever its length: the token run, then the terminal event.
    assert all(len(batch) == 1 and isinstance(batch[0], TokenRun) for batch in rest[:-1])
    assert [type(e) for e in rest[-1]] in ([TokenRun, TokenEvent], [TokenEvent])
    tokens = tokens_of(first + sum(rest, []))
    assert tokens == [expected_token([5, 6], i) for i in range(max_tokens)]
    stamps = [t for batch in rest for e in batch if isinstance(e, TokenRun) for t in e.timestamps_ns]
    assert stamps == sorted(stamps) and all(stamps)


async def test_a_streamed_response_is_read_every_step():
    """Without `whole`, every step's token reaches the reader as it comes."""
    engine = CounterEngine(step_delay_s=0.03)
    with shm_region() as transport, server_thread(engine, transport):
        async with client_for(transport) as client:
            rid = client.submit([5, 6], SamplingParams(max_tokens=8))
            batches = [batch async for batch in client.stream_batches(rid)]
    assert len(batches) >= 4 and batches[-1][-1].finish_reason is FinishReason.LENGTH


def test_a_pass_reads_the_whole_responses_with_most_unread_tokens_first_and_every_stream():
    """spread: streamed slots are always read; of the whole responses due, only the
    WHOLE_READS_PER_PASS with the most unread tokens (a batch in lockstep comes due at one step)."""
    n = 3 * WHOLE_READS_PER_PASS
    whole = np.ones(n, dtype=bool)
    whole[:2] = False  # two streams
    delivered = np.zeros(n, dtype=np.uint64)
    counts = np.arange(n, dtype=np.uint64) + np.uint64(HELD_TOKENS)
    slots = np.arange(n)
    picked = spread(slots, whole, counts, delivered)
    assert picked.tolist() == [0, 1, *range(n - WHOLE_READS_PER_PASS, n)]
    assert spread(slots[:WHOLE_READS_PER_PASS], whole, counts, delivered).tolist() == list(
        range(WHOLE_READS_PER_PASS)
    )


async def test_whole_responses_due_together_all_arrive_whole():
    """More whole responses than one pass reads, decoding in lockstep: each gets all its tokens."""
    count = 2 * WHOLE_READS_PER_PASS + 3
    engine = CounterEngine(max_running=count)
    with shm_region(LONG) as transport, server_thread(engine, transport, LONG):
        async with client_for(transport, LONG) as client:
            params = SamplingParams(max_tokens=HELD_TOKENS + 50, ignore_eos=True)
            ids = [client.submit([7, k], params) for k in range(count)]

            async def tokens(rid: int) -> list[int]:
                batches = [b async for b in client.stream_batches(rid, whole=True)]
                assert batches[-1][-1].finish_reason is FinishReason.LENGTH
                return [t for b in batches for t in tokens_of(b)]

            got = await asyncio.gather(*(tokens(rid) for rid in ids))
    for k, toks in enumerate(got):
        assert toks == [expected_token([7, k], i) for i in range(HELD_TOKENS + 50)]
