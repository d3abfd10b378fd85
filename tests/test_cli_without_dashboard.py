"""`blink-appliance` on a serving host without the dashboard's packages (textual): up and bench still run."""

from __future__ import annotations

import sys

from blink_appliance.cli import build_parser, main


def test_cli_without_textual_refuses_top_only(monkeypatch, capsys):
    # Forget textual and the dashboard (earlier tests may have imported them), then make `import
    # textual` (and so any textual.*) raise ImportError, as on a host without the package.
    for name in [m for m in sys.modules if m.startswith(("blink_appliance.tui", "textual."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "textual", None)
    args = build_parser().parse_args(["up", "p.toml", "--port", "0"])
    assert (args.profile, args.port) == ("p.toml", 0)
    assert build_parser().parse_args(["bench", "interfere", "--spin", "1"]).spin == 1
    assert main(["top", "http://127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err
    assert "blink-appliance top needs the dashboard's packages" in err and "textual" in err
