"""Logprobs through the rings: the engine writes each request's rows into the logprob area where its
record points, the client reads them back with the tokens (docs/protocol.md, "Logprob area")."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from blink_appliance.wire.client import EngineBusyError
from blink_appliance.wire.request import FinishReason, Request, SamplingParams, TokenLogprobs
from tests.ring_support import (
    SMALL,
    CounterEngine,
    client_for,
    collect,
    counter_logprobs,
    expected_events,
    hand_engine_client,
    server_thread,
    shm_region,
)

PROMPT = [5, 9, 14, 3, 27]


def _expected(prompt: list[int], params: SamplingParams):
    tokens = expected_events(prompt, params.max_tokens)
    req = Request(0, prompt, params)
    return [counter_logprobs(req, i, t) for i, t in enumerate(tokens)]


@pytest.mark.parametrize(
    "top_n, prompt_logprobs, max_tokens",
    [
        (0, False, 6),
        (2, False, 6),
        (20, True, 6),
        (3, True, 1),
    ],  # max_tokens 1: the prompt's rows ride the terminal
)
async def test_every_token_and_the_prompt_get_their_rows(top_n, prompt_logprobs, max_tokens):
    params = SamplingParams(
        max_tokens=max_tokens, logprobs=top_n, prompt_logprobs=prompt_logprobs, ignore_eos=True
    )
    with shm_region() as transport, server_thread(CounterEngine(), transport):
        async with client_for(transport) as client:
            plain = client.submit(PROMPT, dataclasses.replace(params, logprobs=None, prompt_logprobs=False))
            asking = client.submit(PROMPT, params)
            plain_events, events = await asyncio.gather(collect(client, plain), collect(client, asking))
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in plain_events)
    assert [e.token_id for e in events] == [e.token_id for e in plain_events]
    want = _expected(PROMPT, params)
    assert [(e.logprobs, e.prompt_logprobs) for e in events] == want
    assert (events[0].prompt_logprobs is not None) == prompt_logprobs


async def test_a_full_area_is_busy_until_a_request_gives_its_rows_back():
    geometry = dataclasses.replace(SMALL, logprob_pairs=64)
    big = SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True)  # 60 of the 64 pairs
    with shm_region(geometry) as transport, server_thread(CounterEngine(), transport, geometry):
        async with client_for(transport, geometry) as client:
            first = client.submit(PROMPT, big)
            with pytest.raises(EngineBusyError, match="logprob area is full"):
                client.submit(PROMPT, big)
            client.submit(PROMPT, dataclasses.replace(big, logprobs=None))  # no rows: not held back
            await collect(client, first)
            events = await collect(client, client.submit(PROMPT, big))
            assert [e.logprobs for e in events] == [lp for lp, _ in _expected(PROMPT, big)]
            with pytest.raises(ValueError, match="need 105 .* holds 64"):
                client.submit(PROMPT, dataclasses.replace(big, max_tokens=35))


async def test_a_token_whose_logprob_row_names_another_token_ends_the_stream_with_an_error():
    async with hand_engine_client() as (client, region):
        rid = client.submit([5, 6], SamplingParams(max_tokens=4, logprobs=1))
        pending = client._by_id[rid]
        slot, first = pending.slot, pending.logprobs.offset
        good, stale = TokenLogprobs(70, -0.5, ((70, -0.5),)), TokenLogprobs(3, -1.0, ((3, -1.0),))
        region.write_logprob_rows(first, [good, stale], 2)  # token 1's row still holds an old request's
        region.write_output_token(slot, 0, 70, 1000)
        region.write_output_token(slot, 1, 71, 1001)
        region.store_progress(slot, "count", 2)
        events = await asyncio.wait_for(collect(client, rid), 5)
        assert region.load_ctl(slot, "cancel") == pending.generation  # the engine is asked to stop
    assert [e.token_id for e in events[:-1]] == [70] and events[0].logprobs == good
    assert events[-1].finish_reason is FinishReason.ERROR
    assert "logprob row of output token 1 names token 3, not 71" in events[-1].error
