"""The daemon behind `blink-appliance up`: create the rings, start and supervise both processes, drain.

Order of life:
  1. validate the profile, check the front end's port can be listened on and the model's files exist
     (seconds, before anything loads: each failure is one line), pull a named model (both processes
     read it from the local cache);
  2. create the shared region (this process owns it and unlinks it at exit);
  3. start the engine process, wait until it reports RUNNING on the ring;
  4. start the front-end process, wait for its ready file, print the URL;
  5. supervise: a crashed engine is restarted (its in-flight requests were already failed by the
     front end, which keeps serving); a crashed front end is restarted too;
  6. on SIGTERM/SIGINT: the front end drains (503 for new work, in-flight finishes or is
     cancelled after appliance.drain_timeout_s), then the engine stops, the region goes, exit 0.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from blink_appliance.processes import set_on_signals
from blink_appliance.profile import Profile, ProfileError, ring_geometry
from blink_appliance.wire.client import ENGINE_STALL_LIMIT_S
from blink_appliance.wire.lifecycle import mark_engine_exited

if TYPE_CHECKING:
    from blink_appliance.wire.region import RingRegion

log = logging.getLogger("blink_appliance.daemon")

ENGINE_START_TIMEOUT_S = 600.0  # loading a big checkpoint on a slow disk
FRONTEND_START_TIMEOUT_S = 120.0
_RESTART_WINDOW_S = 300.0  # engine_restarts counts crashes within this window


class StartupError(RuntimeError):
    """A process did not come up; the message says which and why."""


def say(message: str) -> None:
    print(f"[blink] {message}", file=sys.stderr, flush=True)


def ensure_model(source: str, progress: Callable[[str], None] = say) -> None:
    """Pull a named model into the local cache now, so neither process downloads on its own."""
    if source.partition(":")[0] in ("hf", "gguf", "dummy"):
        return  # a local path or random weights: nothing to pull
    from blink_appliance.model import registry

    if registry.is_named(source):
        path = registry.pull(source)
        progress(f"model {source}: {path}")


@dataclasses.dataclass
class _Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        # A session of its own: a signal to the daemon's process group (Ctrl-C, `timeout`,
        # `kill -- -PGID`) reaches the daemon alone, which drains the front end before it stops the
        # engine. A child outlives a killed daemon by at most its parent watch's half second.
        self.proc = subprocess.Popen(self.argv, start_new_session=True)
        say(f"{self.name} started (pid {self.proc.pid})")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait, SIGKILL if it does not go; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within {timeout_s:.0f}s; killing it")
            self.proc.kill()
            return self.proc.wait()


class HeartbeatWatch:
    """The engine's heartbeat word through the daemon's own clock: how long it has stood still."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._value: int | None = None
        self._since = 0.0

    def stuck_for(self, region: RingRegion) -> float | None:
        """Seconds the heartbeat has not moved, once that is past the limit; else None."""
        value, now = region.load("engine_heartbeat_ns"), time.monotonic()
        if value != self._value:
            self._value, self._since = value, now
            return None
        still = now - self._since
        return still if still > self.limit_s else None


class ApplianceDaemon:
    def __init__(
        self, profile: Profile, profile_path: Path, *, host: str | None = None, port: int | None = None
    ) -> None:
        self.profile = profile
        self.profile_path = profile_path
        self.host = host
        self.port = port
        self._stop = threading.Event()
        self._workdir = Path(tempfile.mkdtemp(prefix="blink-appliance-"))
        self._ready_file = self._workdir / "frontend.url"
        me = str(os.getpid())
        py = sys.executable
        self.engine = _Child(
            "engine", [py, "-m", "blink_appliance.engine.process", str(profile_path), "--parent-pid", me]
        )
        fe_argv = [
            py,
            "-m",
            "blink_appliance.frontend",
            str(profile_path),
            "--ready-file",
            str(self._ready_file),
        ]
        fe_argv += ["--parent-pid", me]
        if host is not None:
            fe_argv += ["--host", host]
        if port is not None:
            fe_argv += ["--port", str(port)]
        self.frontend = _Child("frontend", fe_argv)
        self.url: str | None = None
        # An engine alive but stuck: the front end fails its streams at the stall limit, and the
        # daemon then kills it so that the restart below serves again.
        self.engine_watch = HeartbeatWatch(ENGINE_STALL_LIMIT_S)

    # -- the whole life ---------------------------------------------------------------------------
    def run(self) -> int:
        from blink_appliance.wire.region import RingRegion
        from blink_appliance.wire.ring_layout import region_size
        from blink_appliance.wire.shm_transport import RegionInUseError, ShmTransport

        set_on_signals(self._stop, (signal.SIGTERM, signal.SIGINT))
        ensure_model(self.profile.model.model_source)
        geometry = ring_geometry(self.profile)
        try:
            transport = ShmTransport.create(self.profile.appliance.shm_name, region_size(geometry))
        except RegionInUseError as e:
            say(f"error: {e}; is another appliance running? Give this one its own [appliance] shm_name")
            return 1
        region = RingRegion.create(transport, geometry)
        say(f"ring region /dev/shm/{self.profile.appliance.shm_name}: {transport.size / 2**20:.1f} MiB")
        try:
            self._start_engine(region)
            if not self._stop.is_set():
                self._start_frontend()
            if self._stop.is_set():  # stopped while starting: never "ready"
                return self._shutdown(region)
            say(f"ready: {self.url}  (model {self.profile.model.name}; SIGTERM or Ctrl-C drains and stops)")
            print(self.url, flush=True)  # stdout carries only the URL, for scripts
            self._supervise(region)
            return self._shutdown(region)
        except StartupError as e:
            say(f"error: {e}")
            self._shutdown(region)
            return 1
        finally:
            transport.close()
            self._ready_file.unlink(missing_ok=True)
            self._workdir.rmdir()

    def _start_engine(self, region: RingRegion) -> None:
        from blink_appliance.wire.ring_layout import EngineState

        epoch = region.load("engine_epoch")
        # A shutdown word left from before (a stray write, an engine's own request) must not stop
        # the engine this starts: the daemon's own stop is its event, checked below.
        region.store("shutdown", 0)
        self.engine.start()
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not self._stop.is_set():
            # Ours once it took a new epoch with its own pid: "greater than" would never hold after a
            # corrupt epoch word wrapped (begin_epoch), and the daemon would give up on a live engine.
            ours = region.load("engine_pid") == self.engine.pid and region.load("engine_epoch") != epoch
            if ours and region.load("engine_state") == EngineState.RUNNING:
                say("engine is serving")
                return
            code = self.engine.exited()
            if code is not None:
                raise StartupError(
                    f"the engine process exited with code {code} while starting (see its output above)"
                )
            if time.monotonic() > deadline:
                raise StartupError(f"the engine did not start within {ENGINE_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def _start_frontend(self) -> None:
        self._ready_file.unlink(missing_ok=True)
        self.frontend.start()
        deadline = time.monotonic() + FRONTEND_START_TIMEOUT_S
        while not self._ready_file.exists():
            code = self.frontend.exited()
            if code is not None:
                raise StartupError(
                    f"the front end exited with code {code} while starting (see its output above)"
                )
            if self._stop.is_set():
                return
            if time.monotonic() > deadline:
                raise StartupError(f"the front end did not start within {FRONTEND_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        self.url = self._ready_file.read_text().strip()

    def _supervise(self, region: RingRegion) -> None:
        while not self._stop.wait(0.2):
            self._repair_header(region)
            code = self.engine.exited()
            if code is not None:
                mark_engine_exited(region)
                say(f"engine exited with code {code}; its in-flight requests were failed")
                self._restart(self.engine, lambda: self._start_engine(region))
                self.engine_watch = HeartbeatWatch(self.engine_watch.limit_s)  # a full window for the new one
            elif (stuck := self.engine_watch.stuck_for(region)) is not None:
                say(f"engine heartbeat stood still for {stuck:.0f} s; killing it (pid {self.engine.pid})")
                self.engine.kill()  # the next round sees the exit: FAILED, then a restart
            code = self.frontend.exited()
            if code is not None:
                say(f"front end exited with code {code}")
                self._restart(self.frontend, self._start_frontend)

    @staticmethod
    def _repair_header(region: RingRegion) -> None:
        """The region's header is the daemon's (it created the region): every process it starts
        attaches through it, so one overwritten would make each restart fail and the daemon give up.
        The processes serving now read it only when they attach: rewriting it is all that is needed."""
        fault = region.header_fault()
        if fault is not None:
            say(f"the ring region's header was overwritten ({fault}); rewriting it")
            region.write_header()

    def _restart(self, child: _Child, start: Callable[[], None]) -> None:
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < _RESTART_WINDOW_S] + [now]
        limit = self.profile.appliance.engine_restarts
        if len(child.restarts) > limit:
            raise StartupError(
                f"{child.name} crashed {len(child.restarts)} times within {_RESTART_WINDOW_S:.0f}s; giving up"
            )
        say(f"restarting {child.name} ({len(child.restarts)}/{limit})")
        start()

    def _shutdown(self, region: RingRegion) -> int:
        """Front end first (it drains), then the engine; exit code 0 when both went cleanly."""
        say("draining")
        drain = self.profile.appliance.drain_timeout_s
        fe_code = self.frontend.stop(drain + 10.0)
        region.store("shutdown", 1)
        engine_code = self.engine.stop(15.0)
        say(f"stopped (front end exit {fe_code}, engine exit {engine_code})")
        # -SIGTERM: the child was already exiting (the engine on the shutdown word, either on a
        # signal sent to it alone) and ours landed during its interpreter shutdown, where Python's
        # handlers are gone. Both install theirs before they report ready: it stopped as asked.
        clean = (0, None, -signal.SIGTERM)
        return 0 if fe_code in clean and engine_code in clean else 1


def check_port(host: str, port: int, key: str = "frontend.port") -> None:
    """Raise StartupError when (host, port) cannot be listened on now, before the engine spends its
    load time. Bound and released at once: the front end binds it for good once the engine serves."""
    if port == 0:
        return  # any free port: the front end picks one
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"frontend.host {host!r}: cannot be resolved ({e.strerror})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # The options asyncio's create_server sets: a port left in TIME_WAIT by a previous run
            # passes here as it will there, and an IPv6 socket does not claim the IPv4 port too.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                hint = "is another server using it? " if e.errno == errno.EADDRINUSE else ""
                raise StartupError(
                    f"{key}: cannot listen on {host}:{port} ({e.strerror}); {hint}"
                    "choose another with --port or [frontend] port"
                ) from None


def preflight(profile: Profile, *, port_key: str = "frontend.port") -> None:
    """What `up` can find wrong in a second, before it creates the rings or starts the engine."""
    from blink_appliance.model.metadata import check_source_files

    fe, m = profile.frontend, profile.model
    check_port(fe.host, fe.port, port_key)
    try:
        check_source_files(m.model_source)
    except (FileNotFoundError, ValueError) as e:
        key = "models[0].source" if m.source is not None else "models[0].name"
        raise StartupError(f"{key}: {e}") from None


def run_up(profile: Profile, profile_path: Path, *, host: str | None, port: int | None) -> int:
    try:
        profile = profile.with_overrides(host=host, port=port)
    except ProfileError as e:
        say(str(e))
        return 2
    try:
        preflight(profile, port_key="--port" if port is not None else "frontend.port")
    except StartupError as e:
        say(f"error: {e}")
        return 1
    return ApplianceDaemon(profile, profile_path, host=host, port=port).run()
