"""The dashboard, headless (Textual pilot), against a real aiohttp server serving the telemetry
routes from a real TelemetrySource whose engine counters and latency tracker the test drives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiohttp import web
from blink_appliance.frontend.telemetry_routes import add_telemetry_routes
from blink_appliance.tui.app import BlinkDashboard
from blink_appliance.tui.client import Backoff
from blink_appliance.tui.widgets import (
    CoreHeatStrip,
    GpuPanel,
    HostPanel,
    ModelPanel,
    ModelsTable,
    StatusBar,
    UsageBar,
)
from rich.text import Text
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from blink_appliance.telemetry import TelemetrySource, sm_shares
from blink_appliance.telemetry.latency import TokenLatencyTracker

MS = 1_000_000


class Engines:
    """Counters for two models, as the engine client would report them."""

    def __init__(self) -> None:
        self.values = {
            "tiny": {
                "running": 1,
                "waiting": 0,
                "kv_blocks_used": 8,
                "kv_blocks_total": 64,
                "steps": 10,
                "generated_tokens": 10,
                "device": "cpu",
            },
            "small": {
                "running": 2,
                "waiting": 4,
                "kv_blocks_used": 30,
                "kv_blocks_total": 60,
                "steps": 5,
                "generated_tokens": 5,
                "device": "cpu",
            },
        }

    def __call__(self) -> dict[str, dict]:
        return {name: dict(v) for name, v in self.values.items()}


def text_of(widget: Widget) -> str:
    rendered = (
        widget.render()
        if isinstance(widget, StatusBar | GpuPanel | UsageBar | CoreHeatStrip | ModelsTable)
        else widget.content
    )
    return rendered.plain if isinstance(rendered, Text) else str(rendered)


def model_text(app: BlinkDashboard) -> str:
    panel = app.query_one(ModelPanel)
    texts = [text_of(w) for w in panel.children if not isinstance(w, Sparkline)]
    return "\n".join([panel.border_title or "", *texts])


def panel_steps(app: BlinkDashboard) -> str:
    return app.query_one(ModelPanel).border_subtitle or ""


def host_text(app: BlinkDashboard) -> str:
    return "\n".join(text_of(w) for w in app.query_one(HostPanel).children)


async def wait_until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def make_app(source: TelemetrySource) -> web.Application:
    app = web.Application()
    add_telemetry_routes(app, source)
    return app


def record_stream(source: TelemetrySource, model: str, ttft_ms: float, gaps_ms: list[float]) -> None:
    """A request's tokens as the front end stamps them (ending now)."""
    record_into(source.latency(model), ttft_ms, gaps_ms)


def record_into(tracker: TokenLatencyTracker, ttft_ms: float, gaps_ms: list[float]) -> None:
    """A request's TTFT and token gaps into one tracker, ending now."""
    now = time.monotonic_ns()
    first = now - int(sum(gaps_ms) * MS)
    tracker.record_first_token(first - int(ttft_ms * MS), first)
    prev = first
    for gap in gaps_ms:
        tracker.record_token(prev, prev + int(gap * MS))
        prev += int(gap * MS)
    tracker.record_request_done(first, prev, len(gaps_ms) + 1)


@pytest.fixture
def engines() -> Engines:
    return Engines()


@pytest.fixture
def source(engines: Engines) -> TelemetrySource:
    return TelemetrySource(engines, models=["tiny", "small"], interval_s=0.1)


def dashboard(url: str) -> BlinkDashboard:
    return BlinkDashboard(url, backoff=Backoff(initial_s=0.1, maximum_s=0.3))


async def test_panels_show_live_changing_numbers(
    aiohttp_server, source: TelemetrySource, engines: Engines
) -> None:
    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.connection == "live" and app.snapshot is not None)
        text = model_text(app)
        assert "model tiny · cpu" in text
        assert "batch 1  queue 0" in text and panel_steps(app) == "10 steps"
        assert "KV" in text and "8/64 blocks 12%" in text
        assert "ITL  p50 —" in text  # no tokens yet: nothing, not zero
        assert "SMs n/a" in text  # CPU engine: no SM partition
        assert "● live" in text_of(app.query_one(StatusBar))

        engines.values["tiny"].update(
            running=6, waiting=3, steps=250, kv_blocks_used=48, last_step_ns=4_500_000
        )
        record_stream(source, "tiny", ttft_ms=85.0, gaps_ms=[20.0] * 30)
        await wait_until(
            pilot, lambda: "batch 6" in model_text(app) and "ITL  p50 20.0 ms" in model_text(app)
        )
        text = model_text(app)
        assert "queue 3  step 4.5 ms" in text and panel_steps(app) == "250 steps"
        assert "48/64 blocks 75%" in text
        assert "TTFT p50 85.0 ms" in text
        assert "TPOT p50 20.0 ms" in text
        assert "total 31" in text

        # More tokens, slower: the numbers keep moving.
        record_stream(source, "tiny", ttft_ms=120.0, gaps_ms=[40.0] * 60)
        await wait_until(pilot, lambda: "total 92" in model_text(app))
        assert "ITL  p50 40.0 ms" in model_text(app)

        # The sparklines fill in as whole seconds of history complete.
        rate_spark = app.query_one("#rate-spark", Sparkline)
        itl_spark = app.query_one("#itl-spark", Sparkline)
        await wait_until(pilot, lambda: bool(rate_spark.data) and max(rate_spark.data) > 0)
        assert itl_spark.data and max(itl_spark.data) >= 20.0

        host = host_text(app)
        assert "interference ●" in host and "sched p50" in host
        assert len(app.query_one(CoreHeatStrip).loads) == len(app.snapshot.host.cpu_percent_per_core)
        if not app.snapshot.gpu.available:
            assert "util n/a  mem n/a" in text_of(app.query_one(GpuPanel))
            assert "energy/token n/a" in text_of(app.query_one(GpuPanel))


async def test_keys_switch_model_pause_and_quit(
    aiohttp_server, source: TelemetrySource, engines: Engines
) -> None:
    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.snapshot is not None)
        assert "model tiny" in model_text(app)
        await pilot.press("tab")
        assert "model small" in model_text(app)
        assert "batch 2  queue 4" in model_text(app)
        await pilot.press("m")
        assert "model tiny" in model_text(app)

        await pilot.press("p")
        assert "paused" in text_of(app.query_one(StatusBar))
        engines.values["tiny"]["running"] = 9
        received = app.snapshots_received
        await wait_until(pilot, lambda: app.snapshots_received >= received + 3)
        assert "batch 1" in model_text(app)  # frozen while paused
        await pilot.press("p")
        await wait_until(pilot, lambda: "batch 9" in model_text(app))

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_disconnect_and_reconnect(aiohttp_server, source: TelemetrySource, engines: Engines) -> None:
    server = await aiohttp_server(make_app(source))
    port = server.port
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.connection == "live" and app.snapshot is not None)
        await server.close()  # the appliance goes away
        await wait_until(pilot, lambda: app.connection == "disconnected")
        status = text_of(app.query_one(StatusBar))
        assert "○ disconnected" in status and "retry in" in status
        assert app.query_one("#body").has_class("-stale")
        assert "batch 1" in model_text(app)  # last numbers stay visible, greyed

        engines.values["tiny"]["running"] = 7
        await aiohttp_server(make_app(source), port=port)  # the appliance restarts
        await wait_until(pilot, lambda: app.connection == "live" and "batch 7" in model_text(app))
        assert not app.query_one("#body").has_class("-stale")


async def test_unreachable_appliance_shows_disconnected() -> None:
    app = dashboard("http://127.0.0.1:9")  # discard port: nothing listens
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.connection == "disconnected")
        assert "connection refused" in text_of(app.query_one(StatusBar))
        assert "no models reported yet" in model_text(app)
        assert "n/a" in host_text(app)
        await asyncio.sleep(0)


async def test_api_key_reaches_the_telemetry_stream(aiohttp_server, source: TelemetrySource) -> None:
    from blink_appliance.frontend.app import openai_errors
    from blink_appliance.frontend.auth import bearer_auth_middleware

    app_with_keys = web.Application(middlewares=[openai_errors, bearer_auth_middleware(("secret",))])
    add_telemetry_routes(app_with_keys, source)
    server = await aiohttp_server(app_with_keys)
    url = str(server.make_url(""))

    keyless = dashboard(url)
    async with keyless.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: keyless.connection == "disconnected")
        assert "401" in text_of(keyless.query_one(StatusBar))

    keyed = BlinkDashboard(url, backoff=Backoff(initial_s=0.1, maximum_s=0.3), api_key="secret")
    async with keyed.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: keyed.connection == "live" and keyed.snapshot is not None)


async def test_question_mark_shows_the_keys(aiohttp_server, source: TelemetrySource) -> None:
    from blink_appliance.tui.keys import KEYS, KeysScreen

    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.snapshot is not None)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, KeysScreen))
        shown = str(app.screen.query_one("#keys", Static).render())
        listed = {keys for keys, _ in KEYS}
        assert {"tab, m", "shift+tab", "p", "?", "q"} <= listed
        for binding in app.BINDINGS:  # every key the app takes is on the list
            key = binding.key_display or binding.key
            assert any(key in keys.split(", ") for keys in listed), key
        assert shown  # rendered
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: not isinstance(app.screen, KeysScreen))
        assert "model tiny" in model_text(app)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, KeysScreen))
        await pilot.press("q")  # quits from the list too
        await pilot.pause()
    assert app.return_code == 0


async def test_host_panel_shows_each_process_and_the_verdict(aiohttp_server, engines: Engines) -> None:
    """Daemon, front end and engine each on a line; others and the run-queue wait; the verdict."""
    import os

    from blink_appliance.telemetry import HostSampler

    parent = os.getppid()
    host = HostSampler({"daemon": parent, "frontend": os.getpid()})
    source = TelemetrySource(engines, models=["tiny"], host=host, interval_s=0.1)
    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(
            pilot, lambda: app.snapshot is not None and app.snapshot.host.interference is not None
        )
        text = host_text(app)
        assert "  daemon " in text and "  frontend " in text and "others " in text
        assert "run-queue wait " in text
        assert f"interference ● {app.snapshot.host.interference}" in text


async def test_a_row_per_model_with_its_sm_share_tpot_rate_and_kv(aiohttp_server, engines: Engines) -> None:
    """Two models on one GPU (issue 21): a row each above the panels, the panel's model marked."""
    source = TelemetrySource(
        engines,
        models=["tiny", "small"],
        interval_s=0.1,
        devices={"tiny": "cuda:0", "small": "cuda:0"},
        sm_shares=sm_shares([("tiny", "cuda:0", 100), ("small", "cuda:0", None)]),
    )
    record_stream(source, "small", ttft_ms=50.0, gaps_ms=[12.0] * 20)
    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ModelsTable)
        assert table.display
        tiny, small = text_of(table).splitlines()
        assert tiny.startswith("▸ tiny ") and small.startswith("  small ")
        assert "SMs 100" in tiny and "SMs rest" in small
        assert "TPOT p50 —" in tiny and "TPOT p50 12.0 ms" in small
        assert "KV 12%" in tiny and "KV 50%" in small
        assert "tokens/s 0.0" in tiny and "tokens/s 0.0" not in small
        assert "SMs 100  GPU" in model_text(app)
        await pilot.press("tab")
        assert text_of(table).splitlines()[1].startswith("▸ small")
        assert "SMs rest  GPU" in model_text(app)


async def test_one_model_has_no_rows_above_its_panel(aiohttp_server, engines: Engines) -> None:
    del engines.values["small"]
    server = await aiohttp_server(make_app(TelemetrySource(engines, models=["tiny"], interval_s=0.1)))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.snapshot is not None)
        assert not app.query_one(ModelsTable).display


def record_class_stream(
    source: TelemetrySource, model: str, priority: int, ttft_ms: float, gaps_ms: list[float]
) -> None:
    """A request of one priority class, recorded as the front end does: in the model's tracker
    and in its class's (frontend/metrics.py RequestTimer)."""
    record_stream(source, model, ttft_ms, gaps_ms)
    record_into(source.class_latency(model, priority), ttft_ms, gaps_ms)


async def test_priority_classes_side_by_side_once_a_second_class_is_seen(
    aiohttp_server, source: TelemetrySource
) -> None:
    """Issue 22: one class, the panel as before; two, a row per class under the latencies."""
    server = await aiohttp_server(make_app(source))
    app = dashboard(str(server.make_url("")))
    async with app.run_test(size=(100, 30)) as pilot:
        classes = app.query_one("#classes", Static)
        record_class_stream(source, "tiny", 0, ttft_ms=85.0, gaps_ms=[20.0] * 10)
        await wait_until(pilot, lambda: app.snapshot is not None and app.snapshot.models[0].classes)
        assert not classes.display and "priority classes" not in model_text(app)

        record_class_stream(source, "tiny", 10, ttft_ms=400.0, gaps_ms=[50.0] * 10)
        await wait_until(pilot, lambda: classes.display)
        table = text_of(classes).splitlines()
        assert table[0] == "priority classes (ms, 10 s)"
        assert table[1].split() == ["prio", "TTFT", "p50", "p99", "TPOT", "p50", "p99", "tok/s"]
        assert table[2].split()[:5] == ["0", "85.0", "85.0", "20.0", "20.0"]
        assert table[3].split()[:5] == ["10", "400", "400", "50.0", "50.0"]
        assert len(table) == 4

        # The other model has seen one class: its panel has no table.
        record_class_stream(source, "small", 5, ttft_ms=10.0, gaps_ms=[5.0] * 3)
        await pilot.press("tab")
        await wait_until(pilot, lambda: "model small" in model_text(app))
        await wait_until(pilot, lambda: app.snapshot.models[1].classes != [])
        assert not classes.display
