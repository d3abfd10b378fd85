"""`blink-appliance top`: a live dashboard of a running appliance's telemetry.

Run: `python -m blink_appliance.tui.app [URL]` or, from the CLI, `run_dashboard(url)`.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import aiohttp
from blink_appliance.tui.client import Backoff, stream_snapshots
from blink_appliance.tui.keys import KeysScreen
from blink_appliance.tui.widgets import GpuPanel, HostPanel, ModelPanel, ModelsTable, StatusBar
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Header

from blink_appliance.telemetry.snapshot import TelemetrySnapshot

DEFAULT_URL = "http://127.0.0.1:8000"


def describe_error(error: BaseException) -> str:
    if isinstance(error, aiohttp.ClientConnectorError):
        return (
            "connection refused"
            if isinstance(error.os_error, ConnectionRefusedError)
            else str(error.os_error)
        )
    if isinstance(error, aiohttp.ClientResponseError):
        return f"HTTP {error.status}"
    if isinstance(error, TimeoutError):
        return "no data (timeout)"
    return type(error).__name__


class BlinkDashboard(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "blink-appliance top"
    BINDINGS = [
        # priority: tab would otherwise move focus, and nothing here takes focus.
        Binding("tab", "next_model", "model", priority=True),
        Binding("m", "next_model", "model", show=False),
        Binding("shift+tab", "previous_model", "previous model", show=False, priority=True),
        Binding("p", "toggle_pause", "pause"),
        Binding("question_mark", "show_keys", "keys", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    snapshot: reactive[TelemetrySnapshot | None] = reactive(None)
    model_index: reactive[int] = reactive(0)
    paused: reactive[bool] = reactive(False)
    connection: reactive[str] = reactive("connecting")
    connection_detail: reactive[str] = reactive("")

    def __init__(
        self, url: str = DEFAULT_URL, *, backoff: Backoff | None = None, api_key: str | None = None
    ) -> None:
        super().__init__()
        self.url = url
        # With API keys configured, /telemetry* needs a bearer key like /v1/* does (frontend/auth.py).
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backoff = backoff if backoff is not None else Backoff()
        self.snapshots_received = 0

    def compose(self) -> ComposeResult:
        yield Header()
        yield StatusBar(id="status")
        yield ModelsTable(id="models")
        with Horizontal(id="body"):
            yield ModelPanel(id="model")
            with Vertical(id="side"):
                yield GpuPanel(id="gpu")
                yield HostPanel(id="host")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.url
        self.run_worker(self._follow_stream(), name="telemetry-stream", exclusive=True)

    async def _follow_stream(self) -> None:
        async with aiohttp.ClientSession(headers=self._headers) as session:
            while True:
                self.connection = "connecting"
                self.connection_detail = ""
                try:
                    async for snapshot in stream_snapshots(session, self.url):
                        if self.connection != "live":
                            self.connection = "live"
                            self.backoff.reset()
                        self._receive(snapshot)
                    reason = "stream ended"
                except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                    reason = describe_error(error)
                delay = self.backoff.next_delay()
                self.connection = "disconnected"
                self.connection_detail = f"({reason}; retry in {delay:.1f} s)"
                await asyncio.sleep(delay)

    def _receive(self, snapshot: TelemetrySnapshot) -> None:
        self.snapshots_received += 1
        if not self.paused:
            self.snapshot = snapshot

    def _model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.snapshot.models) if self.snapshot else ()

    def watch_snapshot(self) -> None:
        self._show()

    def watch_model_index(self) -> None:
        self._show()

    def _widgets_gone(self) -> bool:
        # The stream worker can set state while the app shuts down and its screen is already gone.
        return not self.query(StatusBar)

    def watch_paused(self, paused: bool) -> None:
        if self._widgets_gone():
            return
        self.query_one(StatusBar).paused = paused

    def watch_connection(self, connection: str) -> None:
        if self._widgets_gone():
            return
        self.query_one(StatusBar).connection = connection
        # Keep the last numbers on screen while disconnected, greyed out.
        self.query_one("#body").set_class(connection != "live", "-stale")

    def watch_connection_detail(self, detail: str) -> None:
        if self._widgets_gone():
            return
        self.query_one(StatusBar).detail = detail

    def _show(self) -> None:
        if self._widgets_gone():
            return
        snap = self.snapshot
        names = self._model_names()
        index = self.model_index % len(names) if names else 0
        status = self.query_one(StatusBar)
        status.models = names
        status.selected = index
        status.uptime_s = snap.uptime_s if snap else None
        table = self.query_one(ModelsTable)
        table.models = tuple(snap.models) if snap else ()
        table.selected = index
        panel = self.query_one(ModelPanel)
        panel.model = snap.models[index] if snap and snap.models else None
        panel.gpu = snap.gpu if snap else None
        panel.energy_per_token_j = snap.energy_per_token_j if snap else None
        gpu = self.query_one(GpuPanel)
        gpu.gpu = snap.gpu if snap else None
        gpu.energy_per_token_j = snap.energy_per_token_j if snap else None
        self.query_one(HostPanel).host = snap.host if snap else None

    def action_next_model(self) -> None:
        if self._model_names():
            self.model_index = (self.model_index + 1) % len(self._model_names())

    def action_previous_model(self) -> None:
        if self._model_names():
            self.model_index = (self.model_index - 1) % len(self._model_names())

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_show_keys(self) -> None:
        if not isinstance(self.screen, KeysScreen):
            self.push_screen(KeysScreen())


def run_dashboard(url: str = DEFAULT_URL, api_key: str | None = None) -> None:
    """Entry point for `blink-appliance top [URL]`: runs until the user quits."""
    BlinkDashboard(url, api_key=api_key).run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="blink-appliance top", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    run_dashboard(args.url, args.api_key)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`top`'s arguments, shared by `blink-appliance top` and `python -m blink_appliance.tui.app`."""
    parser.add_argument(
        "url", nargs="?", default=DEFAULT_URL, help=f"appliance base URL (default {DEFAULT_URL})"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("BLINK_API_KEY"),
        help="bearer key, when the appliance has API keys configured (default: $BLINK_API_KEY)",
    )


if __name__ == "__main__":
    main()
