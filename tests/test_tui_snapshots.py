"""SVG snapshots of the dashboard's layout (pytest-textual-snapshot), at 80x24 and 200x60.

The app connects to a real telemetry server (in a thread) whose source always serves one fixed
snapshot, so every time-dependent field is frozen. The latency numbers in it come from a real
TokenLatencyTracker fed a deterministic token schedule on a fake clock.
Update after an intended layout change: pytest tests/test_tui_snapshots.py --snapshot-update
(Last deliberate update, issue 21: the GPU snapshots serve two models, so they gained the row per
model above the panels, and the second model's SM share reads "rest (32)".)
Issue 22 added the two-class snapshots (a CPU model whose requests ran in priority classes 0 and
10: the class table under TTFT); the single-class ones did not change.
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
    ClassLatency,
    EngineCounters,
    GpuStats,
    HostStats,
    LatencyStats,
    ModelTelemetry,
    ProcessStats,
    SmShare,
    TelemetrySnapshot,
    TelemetrySource,
    TokenLatencyTracker,
    interference_verdict,
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


def host_stats(
    per_core: list[float],
    processes: list[tuple[str, int, float, float]],
    *,
    runqueue_ms_per_s: float,
    **probe,
) -> HostStats:
    """Host numbers that add up the way HostSampler adds them: the appliance is the sum of its
    processes, the others are the rest of the busy cores, the verdict follows from both."""
    procs = [ProcessStats(role=r, pid=pid, cpu_percent=c, cpu_seconds=t) for r, pid, c, t in processes]
    appliance = sum(p.cpu_percent or 0.0 for p in procs)
    others = max(0.0, sum(per_core) - appliance)
    return HostStats(
        cpu_percent_per_core=per_core,
        cpu_percent_total=sum(per_core) / len(per_core),
        appliance_pids=[p.pid for p in procs],
        processes=procs,
        appliance_cpu_percent=appliance,
        appliance_share_percent=appliance / len(per_core),
        appliance_cpu_seconds=sum(p.cpu_seconds or 0.0 for p in procs),
        others_cpu_percent=others,
        others_share_percent=others / len(per_core),
        runqueue_ms_per_s=runqueue_ms_per_s,
        interference=interference_verdict(others / len(per_core), runqueue_ms_per_s),
        **probe,
    )


def gpu_snapshot() -> TelemetrySnapshot:
    # Two models on one GPU: llama has a 100-SM partition, qwen runs on the rest (32 SMs).
    def model(name: str, sms: int, running: int, seed: int, share: SmShare) -> ModelTelemetry:
        return ModelTelemetry(
            name=name,
            sm_share=share,
            engine=EngineCounters(
                running=running,
                waiting=3,
                kv_blocks_used=1800,
                kv_blocks_total=4096,
                steps=123456,
                generated_tokens=987654,
                sm_partition=sms,
                last_step_ns=812_000,
                device="NVIDIA H100 80GB HBM3",  # what TelemetrySource shows for cuda:0 with NVML
            ),
            latency=latency_stats(seed),
        )

    return TelemetrySnapshot(
        time_unix=1_800_000_000.0,
        uptime_s=3725.0,
        models=[
            model("llama-3.2-1b", 100, 24, 0, SmShare(kind="partition", sm_count=100)),
            model("qwen3-0.6b", 32, 5, 11, SmShare(kind="rest")),
        ],
        host=host_stats(
            [float((i * 37) % 100) for i in range(16)],
            [("daemon", 100, 0.5, 2.0), ("frontend", 101, 12.0, 95.0), ("engine", 102, 172.5, 715.0)],
            runqueue_ms_per_s=4.0,
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
        # Under a busy loop on both cores: the engine gets part of a core, the others the rest.
        host=host_stats(
            [100.0, 100.0],
            [("daemon", 6, 0.3, 1.0), ("frontend", 7, 14.0, 9.0), ("engine", 8, 68.0, 41.0)],
            runqueue_ms_per_s=412.0,
            sched_p50_us=2100.0,
            sched_p99_us=5200.0,
            sched_max_us=6000.0,
            sched_samples=400,
        ),
        gpu=GpuStats(available=False, reason="NVML unavailable: NVML Shared Library Not Found"),
        energy_per_token_j=None,
    )


def two_class_snapshot() -> TelemetrySnapshot:
    """The CPU snapshot with requests in two priority classes (the latter slower)."""
    snap = cpu_snapshot()
    classes = [
        ClassLatency.of(0, LatencyStats.model_validate(latency_stats(5))),
        ClassLatency.of(10, LatencyStats.model_validate(latency_stats(23))),
    ]
    model = snap.models[0].model_copy(update={"classes": classes})
    return snap.model_copy(update={"models": [model]})


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
    """A CPU appliance under a busy loop: daemon, front end and engine apart, others, contended."""
    snap = cpu_snapshot()
    assert snap.host.interference == "contended" and snap.host.others_share_percent > 50
    assert snap_compare(BlinkDashboard(cpu_url), terminal_size=(80, 24), run_before=until_live)


def test_keys_80x24(snap_compare, cpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(cpu_url), terminal_size=(80, 24), press=["?"], run_before=until_live)


def test_cpu_no_nvml_200x60(snap_compare, cpu_url: str) -> None:
    assert snap_compare(BlinkDashboard(cpu_url), terminal_size=(200, 60), run_before=until_live)


@pytest.fixture
def two_class_url() -> Iterator[str]:
    with serve_in_thread(FrozenSource(two_class_snapshot())) as url:
        yield url


def test_cpu_two_classes_80x24(snap_compare, two_class_url: str) -> None:
    assert snap_compare(BlinkDashboard(two_class_url), terminal_size=(80, 24), run_before=until_live)


def test_cpu_two_classes_200x60(snap_compare, two_class_url: str) -> None:
    assert snap_compare(BlinkDashboard(two_class_url), terminal_size=(200, 60), run_before=until_live)
