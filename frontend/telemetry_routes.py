"""HTTP routes serving telemetry to `blink-appliance top` and to scripts.

GET /telemetry         the latest TelemetrySnapshot as JSON
GET /telemetry/stream  Server-Sent Events, one `event: snapshot` per sample (every ~0.5 s);
                       ends when the client goes or the appliance shuts down
"""

from __future__ import annotations

import logging

from aiohttp import web

from blink_appliance.telemetry.source import TelemetrySource

log = logging.getLogger(__name__)

TELEMETRY_SOURCE = web.AppKey("telemetry_source", TelemetrySource)


def add_telemetry_routes(app: web.Application, source: TelemetrySource) -> None:
    """Register the routes and tie the source's sampler threads to the app's lifetime."""
    app[TELEMETRY_SOURCE] = source
    app.router.add_get("/telemetry", get_telemetry)
    app.router.add_get("/telemetry/stream", stream_telemetry)
    app.on_startup.append(_start_source)
    # on_shutdown runs before aiohttp waits for open handlers, so stopping here ends the streams.
    app.on_shutdown.append(_stop_source)


async def _start_source(app: web.Application) -> None:
    await app[TELEMETRY_SOURCE].start()


async def _stop_source(app: web.Application) -> None:
    await app[TELEMETRY_SOURCE].stop()


async def get_telemetry(request: web.Request) -> web.Response:
    source = request.app[TELEMETRY_SOURCE]
    snapshot = source.latest if source.latest is not None else await source.sample()
    return web.json_response(text=snapshot.to_json())


async def stream_telemetry(request: web.Request) -> web.StreamResponse:
    source = request.app[TELEMETRY_SOURCE]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold events back
        }
    )
    await response.prepare(request)
    seq = 0
    try:
        while (item := await source.next_snapshot(seq)) is not None:
            seq, snapshot = item
            await response.write(f"event: snapshot\nid: {seq}\ndata: {snapshot.to_json()}\n\n".encode())
        await response.write_eof()
    except ConnectionResetError:  # the client went away; nothing more to send
        log.debug("telemetry stream client disconnected after %d snapshots", seq)
    return response
