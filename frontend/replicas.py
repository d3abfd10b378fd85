"""A model's replicas (`replicas = N` in its profile section: one engine and ring region each) behind
the one client its CompletionService talks to. A request goes to the live replica with the fewest
outstanding tokens: prompt and max_tokens at submit, less each token as it streams back.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from blink_appliance.wire.errors import EngineBusyError
from blink_appliance.wire.request import OutputEvent, SamplingParams

# Telemetry words that are not summed over the replicas: the newest stamp, and the first replica's
# epoch and state (each replica has its own; the dashboard shows one).
_NEWEST, _FIRSTS = ("updated_ns",), ("engine_epoch", "engine_state")


@dataclass
class _Placed:
    replica: int
    inner_id: int
    outstanding: int  # tokens this request may still cost its replica


class ReplicaSet:
    """The CompletionService client protocol over several engine clients of one model."""

    def __init__(self, clients: Sequence[Any]) -> None:
        if not clients:
            raise ValueError("a replica set needs at least one client")
        self.clients = list(clients)
        self.outstanding = [0] * len(self.clients)  # per replica
        self._placed: dict[int, _Placed] = {}
        self._next_id = 0

    @property
    def engine_alive(self) -> bool:
        return any(c.engine_alive for c in self.clients)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        """To the live replica with the fewest outstanding tokens; a full one passes it to the next.
        EngineBusyError when every replica is full."""
        cost = len(prompt_ids) + params.max_tokens
        live = [i for i, c in enumerate(self.clients) if c.engine_alive] or list(range(len(self.clients)))
        busy: EngineBusyError | None = None
        for i in sorted(live, key=lambda i: (self.outstanding[i], i)):
            try:
                inner = self.clients[i].submit(prompt_ids, params, priority=priority)
                if inspect.isawaitable(inner):
                    inner = await inner
            except EngineBusyError as e:
                busy = e
                continue
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._placed[request_id] = _Placed(i, int(inner), cost)
            self.outstanding[i] += cost
            return request_id
        assert busy is not None
        raise busy

    async def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[OutputEvent]]:
        placed = self._placed.get(request_id)
        if placed is None:
            raise KeyError(f"unknown or already finished request id {request_id}")
        inner = self.clients[placed.replica].stream_batches(placed.inner_id, whole)
        try:
            # Closed with this stream: leaving early must cancel the request in its engine now.
            async with contextlib.aclosing(inner):
                async for batch in inner:
                    spent = min(placed.outstanding, sum(e.num_tokens for e in batch))
                    placed.outstanding -= spent
                    self.outstanding[placed.replica] -= spent
                    yield batch
        finally:
            self._forget(request_id)

    def abandon(self, request_id: int) -> None:
        placed = self._placed.get(request_id)
        if placed is not None:
            self.clients[placed.replica].abandon(placed.inner_id)
            self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self.outstanding[placed.replica] -= placed.outstanding

    def telemetry(self) -> dict[str, int | float]:
        """The replicas' words summed (occupancy, capacities, counters, step-time buckets), with
        engine_alive 1 only while every replica's engine is."""
        each = [c.telemetry() for c in self.clients]
        out: dict[str, int | float] = {}
        for key in each[0]:
            values = [t[key] for t in each if key in t]
            out[key] = max(values) if key in _NEWEST else values[0] if key in _FIRSTS else sum(values)
        out["engine_alive"] = int(all(t.get("engine_alive", 0) for t in each))
        return out
