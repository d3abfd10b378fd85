"""SIGTERM drain of a live appliance with requests in flight (its own appliance: the test stops it)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.live_appliance import MODEL_NAME, start_appliance


@pytest.mark.slow
async def test_sigterm_drains_inflight_then_exits_zero(tmp_path, smollm2_source):
    pytest.importorskip("blink_appliance.engine.reference.engine", reason="the CPU engine has not landed")
    # A long drain allowance and short requests: on a loaded 2-core host the CPU engine's torch threads
    # fight the neighbours for the cores, and 3 x 64 tokens once outlasted a 60 s drain (the front end
    # then cancels what is left, "client closed": the drain works, the engine was just slow).
    live = await asyncio.to_thread(start_appliance, tmp_path, smollm2_source, drain_timeout_s=300.0)
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": "Count slowly:",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        started = [asyncio.Event() for _ in range(3)]
        async with aiohttp.ClientSession(headers=live.headers) as s:

            async def stream(i: int) -> list[dict | str]:
                events: list[dict | str] = []
                async with s.post(live.url + "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            payload = line[6:].decode().strip()
                            events.append(payload if payload == "[DONE]" else json.loads(payload))
                            started[i].set()
                return events

            inflight = [asyncio.create_task(stream(i)) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            live.proc.send_signal(signal.SIGTERM)
            # While draining: new work is refused with 503 (and Retry-After).
            t0 = time.monotonic()
            refused = None
            while time.monotonic() - t0 < 10 and refused is None:
                async with s.post(live.url + "/v1/completions", json={**body, "max_tokens": 1}) as r:
                    if r.status == 503:
                        refused = (r.headers.get("Retry-After"), await r.json())
                await asyncio.sleep(0.02)
            assert refused is not None, live.log()
            assert refused[0] is not None and "shutting down" in refused[1]["error"]["message"]
            results = await asyncio.wait_for(asyncio.gather(*inflight), 300)
        for events in results:  # every in-flight request finished normally
            assert events[-1] == "[DONE]"
            errors = [e for e in events[:-1] if "error" in e]
            assert not errors, (errors, live.log())
            reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
            assert reasons[-1] == "length" and "error" not in events[-2]
        code = await asyncio.to_thread(live.proc.wait, 60)
        assert code == 0, live.log()
        assert "stopped (front end exit 0, engine exit 0)" in live.log()
    finally:
        live.stop(10)
