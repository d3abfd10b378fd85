"""The `?` screen: every key the dashboard takes, over the dashboard, until `?` or escape."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

# (keys, what they do); the app's BINDINGS carry the same actions.
KEYS: tuple[tuple[str, str], ...] = (
    ("tab, m", "next model"),
    ("shift+tab", "previous model"),
    ("p", "pause / resume the screen (the stream keeps running)"),
    ("?", "show / hide this list"),
    ("q", "quit"),
)


def keys_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for keys, what in KEYS:
        table.add_row(keys, what)
    return table


class KeysScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("question_mark", "dismiss", "close", key_display="?"),
        Binding("escape", "dismiss", "close", show=False),
        # A modal screen takes the keys first; q still quits, as the list says.
        Binding("q", "app.quit", "quit"),
    ]

    def compose(self) -> ComposeResult:
        yield Static(keys_table(), id="keys")

    def on_mount(self) -> None:
        self.query_one("#keys").border_title = "keys"
