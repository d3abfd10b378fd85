"""Slow clients cannot hold a connection (issue 20, defect 9): a request head must arrive within
frontend.header_timeout_s, a body within frontend.body_timeout_s (then 408). Raw sockets play the
slow clients against the front end's own app and runner."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web
from blink_appliance.frontend.app import create_app, runner_for
from blink_appliance.frontend.model_router import ModelRouter

from blink_appliance.profile import parse_profile


@contextlib.asynccontextmanager
async def serving(*, header_timeout_s: float, body_timeout_s: float):
    # The body is refused before the service is asked: a router with no model stands in for the engines.
    app = create_app(ModelRouter([]), api_keys=(), body_timeout_s=body_timeout_s)
    runner = runner_for(app, header_timeout_s=header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)  # to EOF: the server closed the connection


async def test_a_body_that_trickles_gets_a_408_and_the_connection_ends():
    async with serving(header_timeout_s=30.0, body_timeout_s=0.5) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        await writer.drain()
        start = time.monotonic()
        reply = await _read_all(reader, 20)
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 8  # 0.5 s to the 408, then at most 2 s of lingering


async def test_a_head_that_trickles_is_closed_at_the_header_timeout():
    async with serving(header_timeout_s=0.5, body_timeout_s=30.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()
        for part in (b"POST /v1/comp", b"letions HTTP/1.1\r\n", b"Host: x\r\n"):  # never the blank line
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.2)
        assert await _read_all(reader, 20) == b""
        writer.close()
    assert time.monotonic() - start < 10


def test_the_timeouts_are_profile_keys():
    model = {"name": "m", "source": "dummy:tiny", "device": "cpu", "kv_budget_gib": 0.01}
    fe = parse_profile(
        {"models": [model], "frontend": {"header_timeout_s": 5, "body_timeout_s": 7}}, origin="t"
    )
    assert (fe.frontend.header_timeout_s, fe.frontend.body_timeout_s) == (5.0, 7.0)
    defaults = parse_profile({"models": [model]}, origin="t").frontend
    assert (defaults.header_timeout_s, defaults.body_timeout_s, defaults.request_timeout_s) == (
        15.0,
        30.0,
        600.0,
    )
