"""TelemetrySource and its HTTP routes, over aiohttp's test client: JSON, SSE, lifecycle."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from blink_appliance.frontend.telemetry_routes import add_telemetry_routes

from blink_appliance.telemetry import (
    GpuSampler,
    GpuStats,
    SmShare,
    TelemetrySnapshot,
    TelemetrySource,
    sm_shares,
)

MS = 1_000_000


class Counters:
    """Engine counters the test bumps, served the way EngineClient.telemetry() would be."""

    def __init__(self) -> None:
        self.values = {
            "running": 1,
            "waiting": 0,
            "kv_blocks_used": 4,
            "kv_blocks_total": 64,
            "steps": 0,
            "generated_tokens": 0,
            "device": "cpu",
        }
        self.fail: Exception | None = None

    def __call__(self) -> dict[str, dict]:
        if self.fail is not None:
            raise self.fail
        return {"tiny": dict(self.values)}


class MeteredGpu(GpuSampler):
    """A GPU whose energy counter the test advances (the NVML path itself needs a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy_j = 1000.0

    def start(self) -> None:
        pass

    def sample(self) -> GpuStats:
        return GpuStats(available=True, name="test", energy_j=self.energy_j, power_w=300.0)


async def read_events(response, count: int) -> list[TelemetrySnapshot]:
    events: list[TelemetrySnapshot] = []
    data: list[str] = []
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            data.append(line[len("data: ") :])
        elif not line and data:
            events.append(TelemetrySnapshot.from_json("\n".join(data)))
            data = []
            if len(events) == count:
                break
    return events


async def telemetry_once(client, ready, timeout_s: float = 30.0) -> TelemetrySnapshot:
    """GET /telemetry until `ready(snapshot)` holds: the sampler refreshes on its own interval, which a
    loaded host may stretch, so the test waits for the sample it needs, not a fixed time."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get("/telemetry")
        assert response.status == 200
        assert response.content_type == "application/json"
        snap = TelemetrySnapshot.model_validate(await response.json())
        if ready(snap) or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.02)


@pytest.fixture
def counters() -> Counters:
    return Counters()


@pytest.fixture
def source(counters: Counters) -> TelemetrySource:
    return TelemetrySource(counters, models=["tiny"], interval_s=0.05)


@pytest.fixture
async def client(aiohttp_client, source: TelemetrySource):
    app = web.Application()
    add_telemetry_routes(app, source)
    return await aiohttp_client(app)


async def test_get_telemetry_json(client, counters: Counters, source: TelemetrySource) -> None:
    now = time.monotonic_ns()
    source.latency("tiny").record_first_token(now - 40 * MS, now)
    source.latency("tiny").record_token(now, now + 12 * MS)
    counters.values.update(running=3, waiting=2, steps=17)
    # The scheduling probe starts with the app but wakes first a millisecond later, which a loaded host
    # stretches: wait for its first sample as for the counters.
    snap = await telemetry_once(
        client,
        lambda s: (
            (m := s.model("tiny")) is not None
            and m.engine is not None
            and m.engine.steps == 17
            and s.host.sched_samples > 0
        ),
    )
    tiny = snap.model("tiny")
    assert tiny is not None and tiny.engine is not None
    assert (tiny.engine.running, tiny.engine.waiting, tiny.engine.steps) == (3, 2, 17)
    assert tiny.engine.device == "cpu" and tiny.engine.kv_usage == pytest.approx(4 / 64)
    assert tiny.latency.ttft_p50_ms == pytest.approx(40.0)
    assert tiny.latency.itl_p50_ms == pytest.approx(12.0)
    assert len(snap.host.cpu_percent_per_core) > 0
    assert snap.host.sched_samples > 0  # started with the app
    # No NVML here (or a real GPU): either way J/token is not invented without energy readings.
    if not snap.gpu.available:
        assert snap.gpu.power_w is None and snap.energy_per_token_j is None


async def test_stream_sends_changing_snapshots(client, counters: Counters) -> None:
    response = await client.get("/telemetry/stream")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    first = (await read_events(response, 1))[0]
    counters.values["steps"] = 99
    later = await read_events(response, 3)
    assert first.model("tiny").engine.steps == 0
    assert later[-1].model("tiny").engine.steps == 99
    assert later[-1].uptime_s > first.uptime_s
    response.close()


async def test_stream_handler_ends_when_client_leaves(client) -> None:
    server = client.server.runner.server
    response = await client.get("/telemetry/stream")
    await read_events(response, 1)
    assert len(server.connections) == 1
    response.close()
    for _ in range(40):
        if not server.connections:
            break
        await asyncio.sleep(0.05)
    assert not server.connections


async def test_stream_ends_when_source_stops(client, source: TelemetrySource) -> None:
    response = await client.get("/telemetry/stream")
    await read_events(response, 1)
    await source.stop()
    rest = await asyncio.wait_for(response.content.read(), timeout=2.0)
    assert response.content.at_eof()
    assert b"event: snapshot" not in rest or rest.endswith(b"\n\n")


async def test_engine_failure_is_reported_not_invented(client, counters: Counters) -> None:
    counters.fail = ConnectionError("engine restarting")
    snap = await telemetry_once(
        client, lambda s: (m := s.model("tiny")) is not None and m.engine_error is not None
    )
    tiny = snap.model("tiny")
    assert tiny is not None and tiny.engine is None
    assert "engine restarting" in tiny.engine_error


async def test_energy_per_token(counters: Counters) -> None:
    gpu = MeteredGpu()
    source = TelemetrySource(counters, gpu=gpu, interval_s=10.0)
    first = await source.sample()
    assert first.energy_per_token_j is None  # one reading: no delta yet
    gpu.energy_j += 50.0
    counters.values["generated_tokens"] += 200
    snap = await source.sample()
    assert snap.energy_per_token_j == pytest.approx(0.25)
    # Idle: energy keeps flowing but no tokens in the window -> window still spans both.
    gpu.energy_j += 10.0
    snap = await source.sample()
    assert snap.energy_per_token_j == pytest.approx(60.0 / 200)
    # Engine restart resets its token counter: no negative or bogus figure.
    counters.values["generated_tokens"] = 0
    assert (await source.sample()).energy_per_token_j is None


async def test_snapshot_json_round_trip(source: TelemetrySource) -> None:
    snap = await source.sample()
    again = TelemetrySnapshot.from_json(snap.to_json())
    assert again == snap
    assert json.loads(snap.to_json())["models"][0]["engine"]["device"] == "cpu"


@pytest.mark.parametrize(
    ("device", "gpu", "shown"),
    [
        ("cpu", GpuStats(available=False, reason="no NVML"), "cpu"),
        ("cuda:0", GpuStats(available=True, name="NVIDIA H100 80GB HBM3"), "NVIDIA H100 80GB HBM3"),
        ("cuda:1", GpuStats(available=False, reason="no NVML"), "cuda:1"),  # no name to give
    ],
)
async def test_device_is_cpu_or_the_gpus_name(device: str, gpu: GpuStats, shown: str) -> None:
    """The engines do not name their device; the source says "cpu" or the GPU's name, never n/a."""

    class Gpu(GpuSampler):
        def sample(self) -> GpuStats:
            return gpu

    counters = Counters()
    del counters.values["device"]  # as EngineClient.telemetry() reports it
    source = TelemetrySource(counters, models=["tiny"], gpu=Gpu(), device=device)
    snap = await source.sample()
    assert snap.model("tiny").engine.device == shown


def test_sm_shares_follow_the_profiles_sm_counts() -> None:
    shares = sm_shares(
        [("big", "cuda:0", 100), ("small", "cuda:0", None), ("alone", "cuda:1", None), ("cpu", "cpu", None)]
    )
    assert shares["big"] == SmShare(kind="partition", sm_count=100) and shares["big"].label == "100 SMs"
    assert shares["small"] == SmShare(kind="rest") and shares["small"].label == "rest of the GPU"
    assert shares["alone"] == SmShare(kind="whole") and shares["alone"].label == "whole GPU"
    assert shares["cpu"] is None


async def test_two_models_each_reach_the_snapshot_and_the_stream(aiohttp_client) -> None:
    """Each model's engine counters, device, SM share and latencies, in /telemetry and its stream."""
    values = {
        "big": {"running": 6, "kv_blocks_used": 30, "kv_blocks_total": 60, "generated_tokens": 500},
        "small": {"running": 1, "kv_blocks_used": 3, "kv_blocks_total": 40, "generated_tokens": 20},
    }

    class Gpu(GpuSampler):
        def sample(self) -> GpuStats:
            return GpuStats(available=True, name="NVIDIA H100 80GB HBM3")

    source = TelemetrySource(
        lambda: {name: dict(v) for name, v in values.items()},
        models=["big", "small"],
        gpu=Gpu(0),
        interval_s=0.05,
        devices={"big": "cuda:0", "small": "cuda:1"},
        sm_shares=sm_shares([("big", "cuda:0", 100), ("small", "cuda:0", None)]),
    )
    now = time.monotonic_ns()
    tracker = source.latency("small")
    tracker.record_first_token(now - 50 * MS, now - 40 * MS)
    tracker.record_token(now - 40 * MS, now - 20 * MS)
    tracker.record_token(now - 20 * MS, now)
    tracker.record_request_done(now - 40 * MS, now, 3)
    app = web.Application()
    add_telemetry_routes(app, source)
    client = await aiohttp_client(app)

    snap = TelemetrySnapshot.from_json(await (await client.get("/telemetry")).text())
    big, small = snap.model("big"), snap.model("small")
    assert [m.name for m in snap.models] == ["big", "small"]
    assert big.engine.kv_usage == 0.5 and big.engine.running == 6 and small.engine.kv_usage == 0.075
    assert big.engine.device == "NVIDIA H100 80GB HBM3"  # the GPU NVML reads ...
    assert small.engine.device == "cuda:1"  # ... and not another one
    assert big.sm_share == SmShare(kind="partition", sm_count=100)
    assert small.sm_share == SmShare(kind="rest")
    assert small.latency.tpot_p50_ms == pytest.approx(20.0) and small.latency.total_tokens == 3
    assert big.latency.total_tokens == 0

    async with client.get("/telemetry/stream") as r:
        (streamed,) = await read_events(r, 1)
    assert [(m.name, m.sm_share) for m in streamed.models] == [(m.name, m.sm_share) for m in snap.models]


def test_a_snapshot_without_sm_share_still_parses() -> None:
    """One model's snapshot as a front end before issue 21 sent it (no sm_share key)."""
    snap = TelemetrySnapshot.from_json(
        json.dumps(
            {
                "time_unix": 1.0,
                "uptime_s": 2.0,
                "models": [{"name": "tiny", "engine": {"running": 1}, "latency": {"window_s": 10.0}}],
                "host": {"cpu_percent_per_core": [1.0], "cpu_percent_total": 1.0},
                "gpu": {"available": False},
            }
        )
    )
    assert snap.model("tiny").sm_share is None and snap.model("tiny").engine.running == 1
