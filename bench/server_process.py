"""A server under test run as a child process: start, wait until it serves, wait until idle, stop.

Both servers bench/compare starts follow one convention: the first line on stdout is the URL,
printed once the server is ready (`blink-appliance up` and `bench/hf_baseline.py`); everything
else goes to stderr, kept in a log file. The child stays in this process group (no new session),
so whatever ends this process's group ends it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from blink_appliance.processes import stop_child


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log's tail."""


def _get_json(url: str, timeout_s: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


@dataclass
class ServerProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    http: bool = True  # False: the URL names something else (a ring agent's nixl://), no /health to wait on
    proc: subprocess.Popen[str] | None = None
    url: str = ""
    started_s: float = 0.0  # monotonic, when start() began
    ready_after_s: float | None = None  # seconds from start() to healthy
    _url_lines: list[str] = field(default_factory=list)

    def start(self, timeout_s: float) -> None:
        """Start and wait for the URL line, then for /health 200; ServerStartError otherwise."""
        self.started_s = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()  # the child holds its own descriptor
        reader = threading.Thread(target=self._read_url, daemon=True)
        reader.start()
        deadline = self.started_s + timeout_s
        while not self._url_lines:
            if self.proc.poll() is not None:
                reader.join(1.0)
                if not self._url_lines:
                    raise ServerStartError(
                        f"{self.name} exited with code {self.proc.returncode} while starting:\n{self.log_tail()}"
                    )
            if time.monotonic() > deadline:
                self.stop(10.0)
                raise ServerStartError(
                    f"{self.name} did not start within {timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        self.url = self._url_lines[0].strip()
        if not self.url.startswith("http" if self.http else "nixl"):
            self.stop(10.0)
            raise ServerStartError(f"{self.name} printed {self.url!r} instead of its URL:\n{self.log_tail()}")
        if self.http:
            self.wait_healthy(max(1.0, deadline - time.monotonic()))
        self.ready_after_s = time.monotonic() - self.started_s

    def _read_url(self) -> None:
        """The first stdout line is the URL; the rest (a child's stray prints) is drained into the
        log, so a full pipe can never block the server."""
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line:
            self._url_lines.append(line)
        with self.log_path.open("a") as log:
            for rest in self.proc.stdout:
                log.write(f"[stdout] {rest}")
                log.flush()

    def health(self, timeout_s: float = 5.0) -> tuple[int, dict]:
        try:
            return _get_json(self.url + "/health", timeout_s)
        except (OSError, ValueError) as e:
            return 0, {"error": str(e)}

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        status, body = self.health()
        while status != 200:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(f"{self.name} is not healthy ({status} {body}):\n{self.log_tail()}")
            time.sleep(0.2)
            status, body = self.health()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until /health reports no request in flight (the previous run's stragglers are gone)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = self.health()
            if status == 200 and body.get("inflight", 0) == 0:
                return True
            time.sleep(0.2)
        return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the appliance drains), wait, SIGKILL if it does not go; its exit code."""
        if self.proc is None:
            return None
        return stop_child(self.proc, timeout_s)[0]

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
