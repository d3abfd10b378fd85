"""/telemetry of a live `blink-appliance up`: the daemon, the front end and the engine are each
counted (the engine's pid read from the ring header), and the device is named."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.live_appliance import MODEL_NAME


async def test_telemetry_counts_the_daemon_the_front_end_and_the_engine(live):
    expected = {
        "daemon": live.proc.pid,
        "frontend": live.child("blink_appliance.frontend").pid,
        "engine": live.child("blink_appliance.engine.process").pid,
    }
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession(headers=live.headers) as s:
        while True:  # the first sample has no rates yet: wait for one that has
            async with s.get(live.url + "/telemetry") as r:
                snap = await r.json()
            host = snap["host"]
            if host["appliance_cpu_percent"] is not None and len(host["processes"]) == 3:
                break
            assert time.monotonic() < deadline, host
            await asyncio.sleep(0.1)
    procs = {p["role"]: p for p in host["processes"]}
    assert {role: p["pid"] for role, p in procs.items()} == expected
    assert sorted(host["appliance_pids"]) == sorted(expected.values())
    # The engine loaded the model: it has used CPU, and that time is in the appliance's total.
    assert procs["engine"]["cpu_seconds"] > 0.5
    assert host["appliance_cpu_seconds"] >= procs["engine"]["cpu_seconds"]
    assert abs(host["appliance_cpu_percent"] - sum(p["cpu_percent"] for p in procs.values())) < 1e-6
    assert host["others_cpu_percent"] is not None and host["interference"] in ("quiet", "busy", "contended")
    model = snap["models"][0]
    assert model["name"] == MODEL_NAME and model["engine"]["device"] == "cpu"
