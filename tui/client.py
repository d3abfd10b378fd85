"""Reading the appliance's telemetry stream (GET /telemetry/stream, Server-Sent Events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from blink_appliance.telemetry.snapshot import TelemetrySnapshot

STREAM_PATH = "/telemetry/stream"


def stream_url(base_url: str) -> str:
    return base_url.rstrip("/") + STREAM_PATH


async def stream_snapshots(
    session: aiohttp.ClientSession, base_url: str, *, read_timeout_s: float = 5.0
) -> AsyncIterator[TelemetrySnapshot]:
    """Yield snapshots from one connection until it ends.

    Raises aiohttp.ClientError (or TimeoutError when the server goes silent for read_timeout_s;
    it sends a snapshot every ~0.5 s) so the caller can reconnect.
    """
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=3.0, sock_read=read_timeout_s)
    async with session.get(stream_url(base_url), timeout=timeout) as response:
        response.raise_for_status()
        event = "message"
        data: list[str] = []
        async for raw in response.content:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith(":"):  # SSE comment
                continue
            if line:
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "event":
                    event = value
                elif field == "data":
                    data.append(value)
                continue
            # A blank line ends the event.
            if event == "snapshot" and data:
                yield TelemetrySnapshot.from_json("\n".join(data))
            event, data = "message", []


@dataclass
class Backoff:
    """Reconnect delays: initial, doubling up to maximum; reset after a good connection."""

    initial_s: float = 0.5
    maximum_s: float = 8.0
    factor: float = 2.0
    _next: float | None = None

    def next_delay(self) -> float:
        delay = self.initial_s if self._next is None else self._next
        self._next = min(self.maximum_s, delay * self.factor)
        return delay

    def reset(self) -> None:
        self._next = None
