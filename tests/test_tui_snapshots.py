"""SVG snapshots of the dashboard's layout (pytest-textual-snapshot), at 80x24 and 200x60.

The app connects to a real telemetry server (in a thread) whose source always serves one fixed
snapshot, so every time-dependent field is frozen. The latency numbers in it come from a real
TokenLatencyTracker fed a deterministic token schedule on a fake clock.
Update after an intended layout change: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aiohttp import web
from blink_appliance.frontend.telemetry_routes import add_telemetry_routes
from blink_appliance.tui.app import BlinkDashboard
from textual.pilot import Pilot

from blink_appliance.telemetry import (
    EngineCounters,
    GpuStats,
    HostStats,
    ModelTelemetry,
    TelemetrySnapshot,
    TelemetrySource,
    TokenLatencyTracker,
)

MS = 1_000_000
S = 1_000_000_000


def latency_stats(seed: int) -> dict:
    """60 s of traffic with a varying rate, recorded on a fake clock."""
    now = 10_000 * S
    tracker = TokenLatencyTracker(clock=lambda: now)
    start = now - 60 * S
    for second in range(60):
        tokens = 20 + (second * 7 + seed) % 30
        gap = S // tokens
        t = start + second * S
        tracker.record_first_token(t - (80 + (second * 13 + seed) % 50) * MS, t)
        for i in range(1, tokens):
            tracker.record_token(t + (i - 1) * gap, t + i * gap)
        tracker.record_request_done(t, t + (tokens - 1) * gap, tokens)
    return tracker.stats().model_dump()


def gpu_snapshot() -> TelemetrySnapshot:
    def model(name: str, sms: int, running: int, seed: int) -> ModelTelemetry:
        return ModelTelemetry(
            name=name,
            engine=EngineCounters(
                running=running,
                waiting=3,
                kv_blocks_used=1800,
                kv_blocks_total=4096,
                steps=123456,
                generated_tokens=987654,
                sm_partition=sms,
                last_step_ns=812_000,
                device="cuda:0",
            ),
            latency=latency_stats(seed),
        )

    return TelemetrySnapshot(
        time_unix=1_800_000_000.0,
        uptime_s=3725.0,
        models=[model("llama-3.2-1b", 100, 24, 0), model("qwen3-0.6b", 32, 5, 11)],
        host=HostStats(
            cpu_percent_per_core=[float((i * 37) % 100) for i in range(16)],
            cpu_percent_total=48.4,
            appliance_pids=[101, 102],
            appliance_cpu_percent=185.0,
            appliance_share_percent=185.0 / 16,
            appliance_cpu_seconds=812.0,
            sched_p50_us=62.0,
            sched_p99_us=240.0,
            sched_max_us=900.0,
            sched_samples=910,
        ),
        gpu=GpuStats(
            available=True,
            name="NVIDIA H100 80GB HBM3",
            power_w=412.3,
            power_limit_w=700.0,
            energy_j=123456.0,
            gpu_util_percent=87.0,
            mem_util_percent=45.0,
            sm_clock_mhz=1980.0,
            memory_used_mib=51234.0,
            memory_total_mib=81559.0,
        ),
        energy_per_token_j=0.42,
    )


def cpu_snapshot() -> TelemetrySnapshot:
    return TelemetrySnapshot(
        time_unix=1_800_000_000.0,
        uptime_s=42.0,
        models=[
            ModelTelemetry(
                name="tiny",
                engine=EngineCounters(
                    running=2,
                    waiting=0,
                    kv_blocks_used=40,
                    kv_blocks_total=256,
                    steps=900,
                    generated_tokens=1800,
                    device="cpu",
                ),
                latency=latency_stats(5),
            )
        ],
        host=HostStats(
            cpu_percent_per_core=[97.0, 12.0],
            cpu_percent_total=54.5,
            appliance_pids=[7],
            appliance_cpu_percent=96.0,
            appliance_share_percent=48.0,
            appliance_cpu_seconds=30.0,
            sched_p50_us=2100.0,
            sched_p99_us=5200.0,
            sched_max_us=6000.0,
            sched_samples=400,
        ),
        gpu=GpuStats(available=False, reason="NVML unavailable: NVML Shared Library Not Found"),
        energy_per_token_j=None,
    )


class FrozenSource(TelemetrySource):
    """Serves one fixed snapshot through the real routes and sampling task."""

    def __init__(self, snapshot: TelemetrySnapshot) -> None:
        super().__init__(None, interval_s=0.1)
        self._frozen = snapshot

    async def sample(self) -> TelemetrySnapshot:
        return self._frozen


@contextmanager
def serve_in_thread(source: TelemetrySource) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    async def setup() -> None:
        app = web.Application()
        add_telemetry_routes(app, source)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        state["runner"], state["port"] = runner, runner.addresses[0][1]

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(setup())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(state["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(5)
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def until_live(pilot: Pilot) -> None:
    app = pilot.app
    app.sub_title = "http://appliance:8000"  # the test server's port changes from run to run
    deadline = time.monotonic() + 5
    while not (app.connection == "live" and app.snapshot is not None):
        assert time.monotonic() < deadline, "dashboard never went live"
        await pilot.pause(0.05)


@pytest.fixture
def gpu_url() -> Iterator[str]:
    with serve_in_thread(FrozenSource(gpu_snapshot())) as url:
        yield url


@pytest.fixture
def cpu_url() -> Iterator[str]:
    with serve_in_thread(FrozenSource(cpu_snapshot())) as url:
        yield url


def test_gpu_80x24(snap_compare, gpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(gpu_url), terminal_size=(80, 24), run_before=until_live)


def test_gpu_200x60(snap_compare, gpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(gpu_url), terminal_size=(200, 60), run_before=until_live)


def test_gpu_second_model_80x24(snap_compare, gpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(gpu_url), terminal_size=(80, 24), press=["tab"], run_before=until_live)


def test_cpu_no_nvml_80x24(snap_compare, cpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(cpu_url), terminal_size=(80, 24), run_before=until_live)


def test_cpu_no_nvml_200x60(snap_compare, cpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(cpu_url), terminal_size=(200, 60), run_before=until_live)
