"""Turns: how bursts of work share the front end's one event loop.

A batch job's requests come and go together: hundreds arrive at once, and a whole (not streamed)
response gets its tokens in large batches (EngineClient.stream_batches with `whole`). Done in one
go, either holds the loop, and every stream waits that long for its next token. Instead each takes
turns, one per event-loop iteration, the most urgent class (the smallest priority) first: a request
before it is prepared and submitted (CompletionService._turn), a whole response for each batch of
its tokens (a slice at a time of a long one; its last batch brings the text, body and write).
Streams and more urgent work run between any two turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

SLICE_TOKENS = 64  # its text and metrics take under a millisecond of the loop


class Turns:
    def __init__(self, slice_tokens: int = SLICE_TOKENS) -> None:
        self.slice_tokens = slice_tokens
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._granting = False

    async def take(self, priority: int) -> None:
        """Wait for a turn: one per loop iteration, by (priority, arrival). The first one of an
        iteration in which nobody waits goes at once: a lone request costs no iteration."""
        loop = asyncio.get_running_loop()
        if not self._granting:
            self._granting = True
            loop.call_soon(self._grant)  # from the next iteration on, the waiting ones one by one
            return
        turn: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), turn))
        await turn

    def _grant(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # its task was cancelled meanwhile
                turn.set_result(None)
                asyncio.get_running_loop().call_soon(self._grant)  # the next one, an iteration later
                return
        self._granting = False

    async def sliced(self, batches: AsyncIterator[list], priority: int) -> AsyncIterator[list]:
        """`batches` handed over a turn each, those longer than a slice a slice per turn. Short ones
        take a turn too: a whole response's last batch brings its whole text, body and write (about
        2 ms at 2k tokens), and a batch job's responses end together. Closing this closes `batches`."""
        async with contextlib.aclosing(batches):  # type: ignore[type-var]
            async for batch in batches:
                for start in range(0, max(len(batch), 1), self.slice_tokens):  # an empty batch: one turn
                    await self.take(priority)
                    yield batch[start : start + self.slice_tokens]
