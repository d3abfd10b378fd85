"""frontend/turns.py: whole responses hand their tokens over a slice per event-loop iteration, the
most urgent class first, so other tasks run between any two slices."""

from __future__ import annotations

import asyncio

from blink_appliance.frontend.turns import Turns


async def test_turns_go_by_priority_then_arrival_one_per_loop_iteration():
    turns, order = Turns(), []

    async def waiter(name: str, priority: int) -> None:
        await turns.take(priority)
        order.append(name)

    tasks = [asyncio.create_task(waiter(n, p)) for n, p in (("be1", 2), ("ls", 0), ("be2", 2), ("mid", 1))]
    ticks = 0

    async def ticker() -> None:  # counts loop iterations while the turns are handed out
        nonlocal ticks
        while sum(not x.startswith("tick") for x in order) < 4:
            order.append(f"tick{ticks}")
            ticks += 1
            await asyncio.sleep(0)

    await asyncio.gather(ticker(), *tasks)
    granted = [x for x in order if not x.startswith("tick")]
    assert granted == ["be1", "ls", "mid", "be2"]  # be1 found nobody waiting: it went at once
    # The ticker runs once per loop iteration: between two of its ticks, one turn at most.
    between, per_iteration = 0, []
    for x in order:
        if x.startswith("tick"):
            per_iteration.append(between)
            between = 0
        else:
            between += 1
    assert max(per_iteration + [between]) == 1, order


async def test_a_cancelled_waiter_gives_its_turn_to_the_next():
    turns, order = Turns(), []

    async def waiter(name: str, priority: int) -> None:
        await turns.take(priority)
        order.append(name)

    lead = asyncio.create_task(waiter("lead", 0))  # the iteration's turn: the next two wait
    first = asyncio.create_task(waiter("first", 0))
    second = asyncio.create_task(waiter("second", 1))
    await asyncio.sleep(0)  # all three ran: lead went, the other two wait
    first.cancel()
    await asyncio.gather(lead, first, second, return_exceptions=True)
    assert order == ["lead", "second"]


async def test_sliced_hands_long_batches_over_in_slices_and_closing_it_closes_the_source():
    closed = []

    async def source():
        try:
            yield list(range(3))
            yield list(range(150))
            yield list(range(10))
        finally:
            closed.append(True)

    turns = Turns(slice_tokens=64)
    sizes = [len(b) async for b in turns.sliced(source(), 0)]
    assert sizes == [3, 64, 64, 22, 10] and closed == [True]
    closed.clear()
    sliced = turns.sliced(source(), 0)
    await anext(sliced)
    await sliced.aclose()
    assert closed == [True]


async def test_a_short_batch_such_as_a_responses_last_waits_its_turn_behind_more_urgent_work():
    turns, order = Turns(slice_tokens=64), []

    async def waiter(name: str, priority: int) -> None:
        await turns.take(priority)
        order.append(name)

    async def last_batch():
        yield [7]  # with the terminal event: the response's text, body and write follow at once

    async def whole_response() -> None:
        async for _ in turns.sliced(last_batch(), 2):
            order.append("be last batch")

    lead = asyncio.create_task(waiter("lead", 1))  # takes this iteration's turn: the rest wait
    be = asyncio.create_task(whole_response())
    ls = asyncio.create_task(waiter("ls", 0))
    await asyncio.gather(lead, be, ls)
    assert order == ["lead", "ls", "be last batch"]
