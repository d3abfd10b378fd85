"""Random bytes over the region's words (issue 20, defect 6): the request ring's and the arena's
head and tail words, a channel's count and done words, the header. Whatever is written, every open
stream ends with exactly one terminal event within seconds and never carries a token the engine did
not produce, every slot comes back, and the ring serves again (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blink_appliance.wire.client import EngineClient
from blink_appliance.wire.lifecycle import inconsistent_rings
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason, SamplingParams
from blink_appliance.wire.ring_layout import CHANNEL_CTL, CHANNEL_PROGRESS, FINAL_BIT, RingGeometry
from tests.ring_support import (
    CounterEngine,
    client_for,
    collect,
    expected_events,
    hand_engine_client,
    server_thread,
    shm_region,
    submit_when_free,
    wait_until_async,
)

# Small enough that a few requests carry every head past its ring's capacity: a tail word that falls
# behind by a ring's worth then reads as "full", which is how an untrusted tail used to block for good.
TINY = RingGeometry(
    request_slots=4,
    arena_tokens=64,
    max_prompt_tokens=16,
    max_inflight=8,
    max_output_tokens=32,
    max_stop_ids=2,
)
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def prompt(i: int) -> list[int]:
    return [i + 3] * 12


@dataclasses.dataclass(frozen=True)
class Overwrite:
    """What is written over a word: `n` added to what it holds (near: the values a protocol check
    must catch, such as a head a few records ahead) or `n` itself; `top` also sets the top bit (a
    count word's FINAL_BIT)."""

    near: bool
    n: int
    top: bool = False

    def apply(self, old: int) -> int:
        value = (old + self.n) % 2**64 if self.near else self.n
        return value | FINAL_BIT if self.top else value


NEAR = st.builds(Overwrite, near=st.just(True), n=st.integers(-40, 40), top=st.booleans())
ANY = st.builds(Overwrite, near=st.just(False), n=st.integers(0, 2**64 - 1), top=st.booleans())
OVERWRITES = NEAR | ANY


def overwrite_word(region: RingRegion, word: str, slot: int, overwrite: Overwrite) -> None:
    if word in ("count", "done"):
        region.store_progress(slot, word, overwrite.apply(region.load_progress(slot, word)))
    else:
        region.store(word, overwrite.apply(region.load(word)))


async def _rest(stream) -> list:
    return [event async for event in stream]


async def overwrite_during_streams(word: str, overwrite: Overwrite) -> None:
    """Four streams in flight, then `word` (of stream 0's channel, for count and done) overwritten."""
    engine = CounterEngine(step_delay_s=0.001)
    with shm_region(TINY) as transport, server_thread(engine, transport, TINY) as server:
        async with client_for(transport, TINY) as client:
            # Every slot once, past both rings' capacity: stale tokens and stamps stay behind in the
            # channels, as on a region that has served before.
            warm = [await submit_when_free(client, prompt(i), dataclasses.replace(GREEDY, max_tokens=32))
                    for i in range(TINY.max_inflight)]  # fmt: skip
            await asyncio.gather(*(collect(client, rid) for rid in warm))
            engine.step_delay_s = 0.005  # the overwrite lands while the streams run
            params = dataclasses.replace(GREEDY, max_tokens=MAX_TOKENS)
            ids = [await submit_when_free(client, prompt(i), params) for i in range(4)]
            streams = [client.stream(rid) for rid in ids]
            firsts = [await s.__anext__() for s in streams]
            overwrite_word(server.region, word, client._by_id[ids[0]].slot, overwrite)
            rests = await asyncio.wait_for(asyncio.gather(*(_rest(s) for s in streams)), 10)
            for i, (first, rest) in enumerate(zip(firsts, rests, strict=True)):
                events = [first, *rest]
                tokens = [e.token_id for e in events if e.token_id is not None]
                assert [e.finished for e in events] == [False] * (len(events) - 1) + [True], events
                assert tokens == expected_events(prompt(i), MAX_TOKENS)[: len(tokens)], events
                if i or word not in ("count", "done"):  # a stream whose words were not touched
                    assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
            await wait_until_async(lambda: len(client._free) == TINY.max_inflight, "a slot did not come back")
            events = await asyncio.wait_for(
                collect(client, await submit_when_free(client, [5, 6], GREEDY, 10)), 10
            )
            assert [e.token_id for e in events] == expected_events([5, 6], 8)
            assert events[-1].finish_reason is FinishReason.LENGTH
            await wait_until_async(
                lambda: not inconsistent_rings(server.region), "ring words still contradict"
            )


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(word=st.sampled_from(["req_head", "req_tail", "arena_head", "arena_tail"]), overwrite=OVERWRITES)
@example(
    word="req_head", overwrite=Overwrite(near=True, n=3)
)  # followed, then published where no engine reads
@example(word="req_tail", overwrite=Overwrite(near=True, n=-4))  # "ring full" for good
@example(word="arena_head", overwrite=Overwrite(near=False, n=2**63))  # followed: "arena full" for good
@example(word="arena_tail", overwrite=Overwrite(near=True, n=-64))  # "arena full" for good
def test_a_ring_word_overwritten_mid_stream_loses_no_stream_and_the_ring_serves_again(word, overwrite):
    asyncio.run(overwrite_during_streams(word, overwrite))


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(word=st.sampled_from(["count", "done"]), overwrite=OVERWRITES)
@example(word="done", overwrite=Overwrite(near=True, n=1))  # done = generation with a count not final: hung
@example(word="count", overwrite=Overwrite(near=False, n=2**40))
def test_a_channel_word_overwritten_mid_stream_ends_its_stream_once_with_no_token_it_lacks(word, overwrite):
    asyncio.run(overwrite_during_streams(word, overwrite))


# -- channels played by hand: the test writes the engine's words in the order a fault leaves them -----


async def test_a_done_word_without_a_final_count_ends_the_stream_with_an_error():
    """The count word overwritten between the engine's final count and its done word: the done came
    with a count that is not final, and the stream used to end with no terminal event at all."""
    async with hand_engine_client() as (client, region):
        rid = client.submit([5], dataclasses.replace(GREEDY, max_tokens=4))
        slot, generation = client._by_id[rid].slot, client._by_id[rid].generation
        region.write_output_token(slot, 0, 70, 1000)
        region.write_status(
            slot, finish_ns=1001, finish_code=2, error_code=0, terminal_token=False, detail=""
        )
        region.store_progress(slot, "count", 1)  # the final count, its FINAL_BIT lost
        region.store_progress(slot, "done", generation)
        events = await asyncio.wait_for(collect(client, rid), 5)
        assert [(e.token_id, e.finish_reason) for e in events[-1:]] == [(None, FinishReason.ERROR)], events
        assert "came without a final count" in events[-1].error
        assert sum(e.finished for e in events) == 1
        assert client.telemetry()["channel_faults"] == 1


async def test_a_count_past_max_tokens_never_delivers_the_tokens_it_claims():
    """A count word overwritten past the request's max_tokens: the stale tokens a slot's earlier
    request left there (stamped, so they look arrived) used to go out as this request's."""
    async with hand_engine_client() as (client, region):
        for slot in range(client.geometry.max_inflight):  # an earlier, longer request in every slot
            for i in range(12):
                region.write_output_token(slot, i, 9, 555)
        rid = client.submit([5], dataclasses.replace(GREEDY, max_tokens=3))
        slot, generation = client._by_id[rid].slot, client._by_id[rid].generation
        for i in range(3):
            region.write_output_token(slot, i, 70 + i, 1000 + i)
        region.store_progress(slot, "count", 10)
        events = await asyncio.wait_for(collect(client, rid), 5)
        assert len([e for e in events if e.token_id is not None]) <= 3, events
        assert (
            events[-1].finish_reason is FinishReason.ERROR
            and "past the request's max_tokens 3" in events[-1].error
        )
        assert region.load_ctl(slot, "cancel") == generation  # the engine is told to stop writing it


async def test_a_done_word_overwritten_after_the_terminal_still_gives_the_slot_back():
    """The engine finished (status, final count, done) and then the done word was overwritten: the
    stream ends normally, and the slot used to stay taken for good."""
    async with hand_engine_client() as (client, region):
        free = len(client._free)
        rid = client.submit([5], dataclasses.replace(GREEDY, max_tokens=2))
        slot = client._by_id[rid].slot
        for i in range(2):
            region.write_output_token(slot, i, 70 + i, 1000 + i)
        region.write_status(slot, finish_ns=1002, finish_code=2, error_code=0, terminal_token=True, detail="")
        region.store_progress(slot, "count", 2 | FINAL_BIT)
        region.store_progress(slot, "done", 0xDEADBEEF)
        events = await asyncio.wait_for(collect(client, rid), 5)
        assert [(e.token_id, e.finish_reason) for e in events] == [(70, None), (71, FinishReason.LENGTH)]
        await wait_until_async(lambda: len(client._free) == free, "the slot never came back")


# -- a new engine epoch on contradicting ring words ---------------------------------------------------------


@pytest.mark.parametrize("tail_shift", [2**63, -1000], ids=["tail-ahead", "tail-far-behind"])
async def test_an_engine_that_starts_on_contradicting_ring_words_resets_them_and_serves(tail_shift):
    """Random bytes over the tails while no engine runs: the next engine read records where none
    would come, and every request hung (or the ring read as full for good). It restarts both rings
    at their heads, and the same client is served by it."""
    with shm_region(TINY) as transport:
        client = EngineClient.attach(transport, TINY)
        with server_thread(CounterEngine(), transport, TINY) as server:
            await client.start()
            await wait_until_async(lambda: client.engine_alive, "no heartbeat from the first engine")
            for i in range(6):  # heads past both capacities
                await collect(client, await submit_when_free(client, prompt(i), GREEDY, 10))
        region = server.region
        for ring in ("req", "arena"):
            region.store(f"{ring}_tail", (region.load(f"{ring}_head") + tail_shift) % 2**64)
        try:
            with server_thread(CounterEngine(), transport, TINY):
                await wait_until_async(lambda: client.engine_alive, "no heartbeat from the second engine")
                rid = await submit_when_free(client, prompt(1), GREEDY, 10)
                events = await asyncio.wait_for(collect(client, rid), 10)
                assert [e.token_id for e in events] == expected_events(prompt(1), 8)
                assert not inconsistent_rings(region)
        finally:
            await client.close()


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(word=st.sampled_from(["req_head", "arena_head"]), overwrite=OVERWRITES)
@example(word="req_head", overwrite=Overwrite(near=True, n=3))  # published where the engine never reads
@example(word="arena_head", overwrite=Overwrite(near=False, n=2**63))  # "arena full" for good
# Within the engine's reach but past every queued prompt: tokens nobody frees, the arena full for good.
@example(word="arena_head", overwrite=Overwrite(near=False, n=129))
def test_a_front_end_that_starts_on_overwritten_heads_continues_where_the_engine_reads(word, overwrite):
    """A front end restarted after its heads were overwritten (its predecessor died before it put
    them back): it takes the ring's place from the engine's tail and the records published there."""

    async def scenario() -> None:
        with shm_region(TINY) as transport, server_thread(CounterEngine(), transport, TINY) as server:
            async with client_for(transport, TINY) as first:
                for i in range(6):  # heads past both capacities
                    await collect(first, await submit_when_free(first, prompt(i), GREEDY, 10))
            overwrite_word(server.region, word, 0, overwrite)
            async with client_for(transport, TINY) as client:
                rid = await submit_when_free(client, prompt(1), GREEDY, 10)
                events = await asyncio.wait_for(collect(client, rid), 10)
                assert [e.token_id for e in events] == expected_events(prompt(1), 8)
            assert not inconsistent_rings(server.region)

    asyncio.run(scenario())


CTL_BYTES = CHANNEL_CTL.itemsize * TINY.max_inflight
PROG_BYTES = CHANNEL_PROGRESS.itemsize * TINY.max_inflight


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(noise=st.binary(min_size=CTL_BYTES + PROG_BYTES, max_size=CTL_BYTES + PROG_BYTES))
def test_a_front_end_that_starts_on_overwritten_channels_gets_every_slot_back(noise):
    """Random bytes over every channel's generation, cancel, count and done words, then a new front
    end (its predecessor died): it takes each slot whose generation and done differ for one its
    predecessor left open and cancels it, and no engine holds them. They stayed taken for good, and
    with every slot so, every request got 503. The engine finishes cancelled channels it does not
    serve, and the slots come back."""

    async def scenario() -> None:
        with shm_region(TINY) as transport, server_thread(CounterEngine(), transport, TINY) as server:
            async with client_for(transport, TINY) as first:
                await collect(first, await submit_when_free(first, prompt(0), GREEDY, 10))
            transport.write(server.region.layout.chan_ctl, noise[:CTL_BYTES])
            transport.write(server.region.layout.chan_prog, noise[CTL_BYTES:])
            async with client_for(transport, TINY) as client:
                await wait_until_async(lambda: len(client._free) == TINY.max_inflight, "slots stayed taken")
                rid = await submit_when_free(client, prompt(1), GREEDY, 10)
                events = await asyncio.wait_for(collect(client, rid), 10)
                assert [e.token_id for e in events] == expected_events(prompt(1), 8)

    asyncio.run(scenario())


# -- words the engine keeps: its pid, the telemetry sequence ----------------------------------------


async def test_the_engine_puts_its_pid_back_and_writes_telemetry_over_a_sequence_word_near_2_64():
    """A telemetry sequence word overwritten near 2**64 made the engine's next telemetry write
    overflow (its loop failed); an overwritten engine_pid lost the engine's process in telemetry."""
    engine = CounterEngine()
    with shm_region(TINY) as transport, server_thread(engine, transport, TINY) as server:
        async with client_for(transport, TINY) as client:
            server.region.store("engine_pid", 12345)
            server.region.store("telemetry_seq", 2**64 - 2)
            await collect(client, await submit_when_free(client, prompt(0), GREEDY, 10))
            await wait_until_async(
                lambda: server.region.load("engine_pid") == os.getpid(), "pid not put back"
            )
            await wait_until_async(lambda: client.telemetry()["requests_finished"] >= 1, "no telemetry")
            assert server.region.load("telemetry_seq") < 2**63  # wrapped, not overflowed
