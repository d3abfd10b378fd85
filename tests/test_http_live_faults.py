"""A live `blink-appliance up` under faults and load, over real HTTP: a client that disconnects
mid-stream, 200 concurrent streaming clients, the dashboard following live requests, the front end
stopped (SIGSTOP) mid-stream, random bytes over the ring region, and crashes of the engine and of
the front end. One appliance (tests/conftest.py's `live`) serves the module; the crash tests restart
its processes and run last.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import aiohttp
import pytest

from tests.live_appliance import (
    API_KEY,
    MODEL_NAME,
    LiveAppliance,
    completion_request,
    post_json,
    stream_events,
)

# -- cancellation, load, crash ------------------------------------------------------------------


async def _stream_into(live: LiveAppliance, body: dict, out: list[dict | str]) -> None:
    """A streaming request whose SSE payloads land in `out` as they arrive ("[DONE]" as a string)."""
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.post(live.url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: "):
                    payload = line[6:].decode().strip()
                    out.append(payload if payload == "[DONE]" else json.loads(payload))


def _terminal(events: list[dict | str]) -> dict:
    """A stream's one terminal event (a chunk with a finish reason, or an error), checked to be its
    last before [DONE]."""
    terminals = [
        e for e in events if isinstance(e, dict) and ("error" in e or e["choices"][0]["finish_reason"])
    ]
    assert len(terminals) == 1 and events[-2:] == [terminals[0], "[DONE]"], events[-3:]
    return terminals[0]


async def _open_streams(live: LiveAppliance, n: int, body: dict) -> tuple[list[asyncio.Task], list[list]]:
    """`n` streaming requests, returned once each has sent a few events (its tokens are flowing)."""
    streams: list[list[dict | str]] = [[] for _ in range(n)]
    tasks = [asyncio.create_task(_stream_into(live, body, out)) for out in streams]
    deadline = time.monotonic() + 60
    while any(len(out) < 3 for out in streams):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks), (streams, live.log())
        await asyncio.sleep(0.05)
    return tasks, streams


async def _served_again(live: LiveAppliance, within_s: float) -> dict:
    """Retry a short request until it gets a 200 (503s while the appliance recovers); its body."""
    deadline = time.monotonic() + within_s
    while True:
        status, r, _ = await post_json(live, "/v1/completions", completion_request("Hello", max_tokens=2))
        if status == 200:
            return r
        assert status == 503 and time.monotonic() < deadline, (status, r, live.log())
        await asyncio.sleep(0.5)


async def _engine_counter(live: LiveAppliance, name: str) -> int:
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/metrics") as r:
            text = await r.text()
    for line in text.splitlines():
        if line.startswith(name):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def test_client_disconnect_cancels_the_request(live):
    body = completion_request("Tell me a long story.", max_tokens=400, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession(headers=live.headers) as s:
        resp = await s.post(live.url + "/v1/completions", json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
            if seen >= 4:
                break
        resp.close()  # drop the connection mid-stream
    t0 = time.monotonic()
    # 400 tokens would take many seconds on this CPU; the engine must be idle again long before.
    while time.monotonic() - t0 < 10:
        if await _engine_counter(live, "blink_num_requests_running") == 0:
            break
        await asyncio.sleep(0.1)
    assert await _engine_counter(live, "blink_num_requests_running") == 0
    assert time.monotonic() - t0 < 10
    assert await _engine_counter(live, 'blink_request_success_total{finished_reason="abort"') >= 1


@pytest.mark.slow
async def test_200_concurrent_streaming_clients_all_complete(live):
    async def one(i: int) -> tuple[int, str | None, bool]:
        events = await stream_events(
            live, "/v1/completions", completion_request(f"Request {i}:", max_tokens=3, ignore_eos=True)
        )
        dicts = [e for e in events if isinstance(e, dict)]
        reason = next(
            (c["choices"][0]["finish_reason"] for c in dicts if c["choices"][0]["finish_reason"]), None
        )
        return i, reason, events[-1] == "[DONE]"

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=150)
    assert len(results) == 200
    assert all(reason == "length" and done for _, reason, done in results), results


async def test_dashboard_shows_live_changing_numbers(live):
    """`blink-appliance top` (headless, Textual pilot) against this appliance: numbers move after requests."""
    from blink_appliance.tui.app import BlinkDashboard
    from blink_appliance.tui.widgets import ModelPanel

    app = BlinkDashboard(live.url, api_key=API_KEY)  # the appliance has API keys: /telemetry needs one

    def total_tokens() -> int | None:
        model = app.snapshot.model(MODEL_NAME) if app.snapshot is not None else None
        return None if model is None else model.latency.total_tokens

    def panel_text() -> str:
        panel = app.query_one(ModelPanel)
        return "\n".join(str(w.render()) for w in panel.query("Static"))

    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 20
        while app.connection != "live" or total_tokens() is None:
            assert time.monotonic() < deadline, app.connection
            await pilot.pause(0.1)
        before = total_tokens()
        await asyncio.gather(
            *(stream_events(live, "/v1/completions", completion_request(f"Count {i}:", max_tokens=6, ignore_eos=True))
              for i in range(3))
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while total_tokens() < before + 18:
            assert time.monotonic() < deadline, (before, total_tokens())
            await pilot.pause(0.1)
        await pilot.pause(0.3)  # one more refresh, so the panel shows what the snapshot holds
        assert MODEL_NAME in (app.query_one(ModelPanel).border_title or "")
        assert f"total {total_tokens()}" in panel_text(), panel_text()


async def test_frontend_stopped_for_seconds_mid_stream_loses_no_stream(live):
    """SIGSTOP of the front end for 2 s during 4 streams (a debugger, a host that starves it): the
    daemon leaves a stopped process alone (it acts on exits), the engine keeps generating for it (it
    takes requests back only after FRONTEND_TIMEOUT_S, 5 s, without the front end's heartbeat), and
    every stream finishes normally once the front end continues."""
    frontend = live.child("blink_appliance.frontend")
    body = completion_request("Count to a hundred.", max_tokens=40, ignore_eos=True)
    tasks, streams = await _open_streams(live, 4, body)
    frontend.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2.0)  # the fault: stopped this long
    finally:
        frontend.send_signal(signal.SIGCONT)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for events in streams:
        assert _terminal(events)["choices"][0]["finish_reason"] == "length", events[-3:]
    assert live.child("blink_appliance.frontend").pid == frontend.pid
    assert "front end exited" not in live.log()


async def test_frontend_stopped_past_the_engine_timeout_ends_each_stream_once_and_serves_again(live):
    """Stopped until the engine takes its requests back (5 s without the front end's heartbeat, as from
    a dead front end: their slots must not wait forever): once it continues, each stream ends with that
    one error event (frontend_lost) and [DONE], and the same front end serves new requests."""
    frontend = live.child("blink_appliance.frontend")
    body = completion_request("Write a long story.", max_tokens=400, ignore_eos=True)
    tasks, streams = await _open_streams(live, 4, body)
    reclaims = live.log_path.read_text(errors="replace").count("front end heartbeat stale")
    frontend.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while live.log_path.read_text(errors="replace").count("front end heartbeat stale") == reclaims:
            assert time.monotonic() < deadline, live.log()
            await asyncio.sleep(0.2)
    finally:
        frontend.send_signal(signal.SIGCONT)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for events in streams:
        error = _terminal(events)["error"]
        assert error["code"] == "engine_failure" and "frontend_lost" in error["message"], error
    assert (await _served_again(live, 30))["usage"]["completion_tokens"] >= 1
    assert live.child("blink_appliance.frontend").pid == frontend.pid


async def test_random_bytes_over_the_region_end_each_stream_once_and_it_serves_again(live):
    """Issue 20 defect 6, the probe's reproducer: random bytes over the whole ring region mid-stream
    (header, ring words, channels, records). They stopped the daemon (its next engine refused the
    header) and left the ring unusable. Every stream still ends with one terminal event, the daemon
    rewrites the header, both sides put their ring words back, and new requests are served. The
    shutdown word is kept 0: any other value asks the engine to stop, which the daemon answers with a
    restart (tests/test_daemon_supervision.py); here it must recover without one."""
    from blink_appliance.wire.ring_layout import RingLayout
    from blink_appliance.wire.shm_transport import ShmTransport

    body = completion_request("Write a poem.", max_tokens=60, ignore_eos=True)
    tasks, streams = await _open_streams(live, 4, body)
    transport = ShmTransport.open(live.shm_name)
    try:
        transport.write(0, random.Random(20).randbytes(transport.size))
        transport.store_u64(RingLayout.control("shutdown"), 0)
    finally:
        transport.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for events in streams:
        _terminal(events)
    assert (await _served_again(live, 60))["usage"]["completion_tokens"] >= 1
    assert live.proc.poll() is None, live.log()
    # The daemon's watch finds the header on its own cycle, which may come after the request above.
    deadline = time.monotonic() + 30
    while "header was overwritten" not in live.log():
        assert time.monotonic() < deadline, live.log()
        await asyncio.sleep(0.05)


async def test_zz_engine_crash_fails_inflight_then_recovers(live):
    """Runs last in the module (name): kills the engine with SIGKILL mid-stream."""
    engine = live.child("blink_appliance.engine.process")
    body = completion_request("Write a poem.", max_tokens=300, ignore_eos=True)
    streamed: list[dict | str] = []

    async def streaming() -> None:
        async with aiohttp.ClientSession(headers=live.headers) as s:
            async with s.post(live.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        payload = line[6:].decode().strip()
                        streamed.append(payload if payload == "[DONE]" else json.loads(payload))

    stream_task = asyncio.create_task(streaming())
    whole_task = asyncio.create_task(post_json(live, "/v1/completions", body))
    while len(streamed) < 3:
        await asyncio.sleep(0.05)
    engine.send_signal(signal.SIGKILL)
    status, r, _ = await asyncio.wait_for(whole_task, 30)
    assert status == 503 and r["error"]["code"] == "engine_failure", r
    await asyncio.wait_for(stream_task, 30)
    assert streamed[-1] == "[DONE]"
    assert "error" in streamed[-2] and streamed[-2]["error"]["code"] == "engine_failure"
    # The daemon restarts the engine; the front end kept serving and new requests succeed.
    deadline = time.monotonic() + 180
    while True:
        status, r, _ = await post_json(live, "/v1/completions", completion_request("Hello", max_tokens=2))
        if status == 200:
            break
        assert status == 503, r
        assert time.monotonic() < deadline, live.log()
        await asyncio.sleep(0.5)
    assert r["usage"]["completion_tokens"] >= 1
    assert live.child("blink_appliance.engine.process").pid != engine.pid


async def test_zzz_frontend_crash_is_restarted_and_serves_again(live):
    """Runs last (name): SIGKILL of the front end mid-stream. Its clients lose their connections (no
    terminal event can reach them: docs/reliability.md says they retry); the daemon starts a new
    front end, which serves new requests (that it cancels the orphan: tests/test_ring_server_client.py)."""
    import re

    frontend = live.child("blink_appliance.frontend")
    body = completion_request("Write a poem.", max_tokens=300, ignore_eos=True)
    streamed: list[bytes] = []

    async def streaming() -> None:
        async with aiohttp.ClientSession(headers=live.headers) as s:
            async with s.post(live.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    streamed.append(line)

    stream_task = asyncio.create_task(streaming())
    while len(streamed) < 3:
        await asyncio.sleep(0.05)
    frontend.send_signal(signal.SIGKILL)
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(stream_task, 30)
    assert b"data: [DONE]\n" not in streamed
    deadline = time.monotonic() + 120
    pattern = re.compile(r"front end serving \S+ on (http://\S+)")
    while True:  # the daemon's restart logs its new front end's URL (port 0: a new port)
        urls = pattern.findall(live.log_path.read_text(errors="replace"))
        if len(urls) >= 2:
            break
        assert time.monotonic() < deadline, live.log()
        await asyncio.sleep(0.2)
    live.url = urls[-1]
    while True:
        try:
            status, r, _ = await post_json(live, "/v1/completions", completion_request("Hello", max_tokens=2))
        except aiohttp.ClientError:
            status, r = 0, None
        if status == 200:
            break
        assert time.monotonic() < deadline, live.log()
        await asyncio.sleep(0.5)
    assert r["usage"]["completion_tokens"] >= 1
    assert live.child("blink_appliance.frontend").pid != frontend.pid
