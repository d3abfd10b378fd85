"""TelemetrySource and its HTTP routes, over aiohttp's test client: JSON, SSE, lifecycle."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from blink_appliance.frontend.telemetry_routes import add_telemetry_routes

from blink_appliance.telemetry import GpuSampler, GpuStats, TelemetrySnapshot, TelemetrySource

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
    await asyncio.sleep(0.15)
    response = await client.get("/telemetry")
    assert response.status == 200
    assert response.content_type == "application/json"
    snap = TelemetrySnapshot.model_validate(await response.json())
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
    await asyncio.sleep(0.15)
    snap = TelemetrySnapshot.model_validate(await (await client.get("/telemetry")).json())
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
