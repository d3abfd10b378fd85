"""The daemon behind `blink-appliance up`: create the rings, start and supervise both processes, drain.

Order of life:
  1. validate the profile, check the front end's port can be listened on and every model's files
     exist (seconds, before anything loads: each failure is one line), pull the named models (both
     processes read them from the local cache);
  2. create one shared region per model (profile.region_name; this process owns them and unlinks
     them at exit);
  3. start one engine process per model (several GPU loops on one device, or any sm_count: under a
     private MPS control daemon, each process at its SM share, blink_appliance/mps.py), wait until
     each reports RUNNING on its region;
  4. start the front-end process, wait for its ready file, print the URL;
  5. supervise: a crashed engine is restarted (its in-flight requests were already failed by the
     front end, which keeps serving the other models); a crashed front end is restarted too;
  6. on SIGTERM/SIGINT: the front end drains (503 for new work, in-flight finishes or is
     cancelled after appliance.drain_timeout_s), then the engines stop, MPS quits, the regions go,
     exit 0.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from blink_appliance.processes import ENGINE_STOP_S, FRONTEND_STOP_GRACE_S, set_on_signals, stop_child
from blink_appliance.profile import Profile, ProfileError, region_name, ring_geometry
from blink_appliance.wire.lifecycle import mark_engine_exited

if TYPE_CHECKING:
    from blink_appliance.gpu_sharing import MpsControl
    from blink_appliance.wire.region import RingRegion

log = logging.getLogger("blink_appliance.daemon")

ENGINE_START_TIMEOUT_S = 600.0  # loading a big checkpoint on a slow disk
FRONTEND_START_TIMEOUT_S = 120.0
REMOTE_READ_GRACE_S = 0.5  # a remote front end's pump reads the shutdown terminals within this long
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
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the daemon's environment

    def start(self) -> None:
        # A session of its own: a signal to the daemon's process group (Ctrl-C, `timeout`,
        # `kill -- -PGID`) reaches the daemon alone, which drains the front end before it stops the
        # engine. A child outlives a killed daemon by at most its parent watch's half second.
        env = {**os.environ, **self.env} if self.env else None
        # Their stdout goes to our stderr: ours carries only the URL (a library may print to stdout).
        self.proc = subprocess.Popen(self.argv, start_new_session=True, env=env, stdout=sys.stderr)
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
        if self.proc is None:
            return None
        code, killed = stop_child(self.proc, timeout_s)
        if killed:
            say(f"{self.name} did not stop within {timeout_s:.0f}s; killed it")
        return code


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


@dataclasses.dataclass
class ModelEngine:
    """One model's engine process (`index` into profile.models) and its region's heartbeat watch."""

    index: int
    child: _Child
    watch: HeartbeatWatch


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
        many = len(profile.models) > 1
        # An engine alive but stuck: the front end fails its streams at the stall limit, and the
        # daemon then kills it so that the restart below serves again.
        self.engines = [
            ModelEngine(
                i,
                _Child(
                    (f"engine of {m.name}" if many else "engine")
                    + (f" (replica {m.replica + 1}/{m.replicas})" if m.replicas > 1 else ""),
                    [py, "-m", "blink_appliance.engine.process", str(profile_path)]
                    + ["--model", str(i), "--parent-pid", me],
                ),
                HeartbeatWatch(profile.engine.stall_limit_s),
            )
            for i, m in enumerate(profile.models)
        ]
        self.mps: MpsControl | None = None
        # The process that serves the rings to the front end: the front end itself, or with
        # frontend.transport "nixl" the ring agent that lends them to a front end on another host.
        self.remote_frontend = profile.frontend.transport == "nixl"
        module, name = ("ring_agent", "ring agent") if self.remote_frontend else ("frontend", "frontend")
        self._fe_label = "ring agent" if self.remote_frontend else "front end"  # in messages
        fe_argv = [
            py,
            "-m",
            f"blink_appliance.{module}",
            str(profile_path),
            "--ready-file",
            str(self._ready_file),
        ]
        fe_argv += ["--parent-pid", me]
        if host is not None and not self.remote_frontend:
            fe_argv += ["--host", host]
        if port is not None and not self.remote_frontend:
            fe_argv += ["--port", str(port)]
        self.frontend = _Child(name, fe_argv)
        self.url: str | None = None

    # The first model's engine and its watch: all there is in a one-model appliance.
    @property
    def engine(self) -> _Child:
        return self.engines[0].child

    @engine.setter
    def engine(self, child: _Child) -> None:
        self.engines[0].child = child

    @property
    def engine_watch(self) -> HeartbeatWatch:
        return self.engines[0].watch

    # -- the whole life ---------------------------------------------------------------------------
    def run(self) -> int:
        from blink_appliance.wire.region import RingRegion
        from blink_appliance.wire.ring_layout import region_size
        from blink_appliance.wire.shm_transport import RegionInUseError, ShmTransport

        set_on_signals(self._stop, (signal.SIGTERM, signal.SIGINT))
        for source in dict.fromkeys(m.model_source for m in self.profile.models):
            ensure_model(source)
        transports: list[ShmTransport] = []
        regions: list[RingRegion] = []
        try:
            for i in range(len(self.profile.models)):
                name, geometry = region_name(self.profile, i), ring_geometry(self.profile, i)
                try:
                    transport = ShmTransport.create(name, region_size(geometry))
                except RegionInUseError as e:
                    say(
                        f"error: {e}; is another appliance running? Give this one its own [appliance] shm_name"
                    )
                    return 1
                transports.append(transport)
                regions.append(RingRegion.create(transport, geometry))
                say(f"ring region /dev/shm/{name}: {transport.size / 2**20:.1f} MiB")
            return self._serve(regions)
        finally:
            for transport in transports:
                transport.close()
            self._ready_file.unlink(missing_ok=True)
            self._workdir.rmdir()

    def _serve(self, regions: list[RingRegion]) -> int:
        try:
            self._share_gpus()
            self._start_engines(regions)
            if not self._stop.is_set():
                self._start_frontend()
            if self._stop.is_set():  # stopped while starting: never "ready"
                return self._shutdown(regions)
            names = list(
                dict.fromkeys(
                    m.name + (f" x{m.replicas}" if m.replicas > 1 else "") for m in self.profile.models
                )
            )
            what = f"model {names[0]}" if len(names) == 1 else f"models {', '.join(names)}"
            say(f"ready: {self.url}  ({what}; SIGTERM or Ctrl-C drains and stops)")
            print(self.url, flush=True)  # stdout carries only the URL, for scripts
            self._supervise(regions)
            return self._shutdown(regions)
        except StartupError as e:
            say(f"error: {e}")
            self._shutdown(regions)
            return 1

    def _share_gpus(self) -> None:
        """Several models on one GPU: the device's free memory, read once for their kv_fractions,
        and when GPU loops share it (or one has sm_count) a private MPS daemon, each engine at its
        SM share (blink_appliance/gpu_sharing.py)."""
        from blink_appliance import gpu_sharing

        try:
            for device in gpu_sharing.shared_devices(self.profile):
                free = str(gpu_sharing.device_free_bytes(device))
                for e in self.engines:
                    if self.profile.models[e.index].device == device:
                        e.child.argv += ["--device-free-bytes", free]
            if not gpu_sharing.mps_needed(self.profile):
                return
            shares = gpu_sharing.plan_shares(self.profile, gpu_sharing.device_sm_count)
            self.mps = gpu_sharing.MpsControl(self._workdir)
            self.mps.start()
        except (gpu_sharing.MpsError, ProfileError) as e:
            raise StartupError(str(e)) from None
        say(f"MPS control daemon started (pipes in {self.mps.pipe_dir})")
        for share in shares:
            child = self.engines[share.model_index].child
            child.env = self.mps.client_env(share)
            say(f"{child.name}: {share.describe()}")

    def _start_engines(self, regions: Sequence[RingRegion]) -> None:
        """Start every model's engine at once (they load in parallel), then wait for each."""
        epochs = [self._launch(e, regions[e.index]) for e in self.engines]
        for e, epoch in zip(self.engines, epochs, strict=True):
            self._await_engine(e, regions[e.index], epoch)

    def _start_engine(self, regions: RingRegion | Sequence[RingRegion], e: ModelEngine | None = None) -> None:
        """Start one model's engine (default: the first) and wait until it serves its region."""
        e = self.engines[0] if e is None else e
        region = _as_list(regions)[e.index]
        self._await_engine(e, region, self._launch(e, region))

    @staticmethod
    def _launch(e: ModelEngine, region: RingRegion) -> int:
        """Start the engine's process; returns its region's epoch from before."""
        epoch = region.load("engine_epoch")
        # A shutdown word left from before (a stray write, an engine's own request) must not stop
        # the engine this starts: the daemon's own stop is its event, checked below.
        region.store("shutdown", 0)
        e.child.start()
        return epoch

    def _await_engine(self, e: ModelEngine, region: RingRegion, epoch: int) -> None:
        from blink_appliance.wire.ring_layout import EngineState

        engine = e.child
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not self._stop.is_set():
            # Ours once it took a new epoch with its own pid: "greater than" would never hold after a
            # corrupt epoch word wrapped (begin_epoch), and the daemon would give up on a live engine.
            ours = region.load("engine_pid") == engine.pid and region.load("engine_epoch") != epoch
            if ours and region.load("engine_state") == EngineState.RUNNING:
                say(f"{engine.name} is serving")
                return
            code = engine.exited()
            if code is not None:
                raise StartupError(
                    f"the {engine.name} process exited with code {code} while starting (see its output above)"
                )
            if time.monotonic() > deadline:
                raise StartupError(f"the {engine.name} did not start within {ENGINE_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def _start_frontend(self) -> None:
        self._ready_file.unlink(missing_ok=True)
        self.frontend.start()
        deadline = time.monotonic() + FRONTEND_START_TIMEOUT_S
        while not self._ready_file.exists():
            code = self.frontend.exited()
            if code is not None:
                raise StartupError(
                    f"the {self._fe_label} exited with code {code} while starting (see its output above)"
                )
            if self._stop.is_set():
                return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"the {self._fe_label} did not start within {FRONTEND_START_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.05)
        self.url = self._ready_file.read_text().strip()

    def _supervise(self, regions: RingRegion | Sequence[RingRegion]) -> None:
        regions = _as_list(regions)
        while not self._stop.wait(0.2):
            for i, region in enumerate(regions):
                self._repair_header(region, region_name(self.profile, i))
            for e in self.engines:
                self._watch_engine(e, regions)
            code = self.frontend.exited()
            if code is not None:
                say(f"{self._fe_label} exited with code {code}")
                self._restart(self.frontend, self._start_frontend)

    def _watch_engine(self, e: ModelEngine, regions: Sequence[RingRegion]) -> None:
        """An engine that exited is marked on its region and restarted; one whose heartbeat stood
        still is killed (the next round restarts it)."""
        engine, region = e.child, regions[e.index]
        code = engine.exited()
        if code is not None:
            mark_engine_exited(region)
            say(f"{engine.name} exited with code {code}; its in-flight requests were failed")
            self._restart(engine, lambda: self._start_engine(regions, e))
            e.watch = HeartbeatWatch(e.watch.limit_s)  # a full window for the new one
        elif (stuck := e.watch.stuck_for(region)) is not None:
            say(f"{engine.name} heartbeat stood still for {stuck:.0f} s; killing it (pid {engine.pid})")
            engine.kill()  # the next round sees the exit: FAILED, then a restart

    @staticmethod
    def _repair_header(region: RingRegion, name: str) -> None:
        """The region's header is the daemon's (it created the region): every process it starts
        attaches through it, so one overwritten would make each restart fail and the daemon give up.
        The processes serving now read it only when they attach: rewriting it is all that is needed."""
        fault = region.header_fault()
        if fault is not None:
            say(f"the ring region {name}'s header was overwritten ({fault}); rewriting it")
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

    def _shutdown(self, regions: Sequence[RingRegion]) -> int:
        """Front end first (it drains), then the engines; exit code 0 when all went cleanly."""
        say("draining")
        drain = self.profile.appliance.drain_timeout_s
        # A remote front end drains on its own host; the ring agent stays until the engines wrote
        # their shutdown terminals, so that front end can read them.
        fe_code = None if self.remote_frontend else self.frontend.stop(drain + FRONTEND_STOP_GRACE_S)
        for region in regions:  # every engine starts stopping now, not after the one before it
            region.store("shutdown", 1)
        codes = {e.child.name: e.child.stop(ENGINE_STOP_S) for e in self.engines}
        if self.remote_frontend:
            time.sleep(REMOTE_READ_GRACE_S if self.frontend.exited() is None else 0.0)
            fe_code = self.frontend.stop(10.0)
        if self.mps is not None:
            self.mps.stop()  # after the engines: they are its clients
        engines = ", ".join(f"{name} exit {code}" for name, code in codes.items())
        say(f"stopped (front end exit {fe_code}, {engines})")
        # -SIGTERM: the child was already exiting (the engine on the shutdown word, either on a
        # signal sent to it alone) and ours landed during its interpreter shutdown, where Python's
        # handlers are gone. Both install theirs before they report ready: it stopped as asked.
        clean = (0, None, -signal.SIGTERM)
        return 0 if all(code in clean for code in (fe_code, *codes.values())) else 1


def _as_list(regions: RingRegion | Sequence[RingRegion]) -> list[RingRegion]:
    """One region per model, by index; a single region stands for a one-model profile's."""
    return list(regions) if isinstance(regions, Sequence) else [regions]


def check_port(host: str, port: int, key: str = "frontend.port") -> None:
    """Raise StartupError when (host, port) cannot be listened on now, before the engine spends its
    load time. Bound and released at once: the front end binds it for good once the engine serves."""
    if port == 0:
        return  # any free port: the front end picks one
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        where = "dpu.listen" if key == "dpu.port" else "frontend.host"
        raise StartupError(f"{where} {host!r}: cannot be resolved ({e.strerror})") from None
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
                    + (
                        "choose another [dpu] port"
                        if key == "dpu.port"
                        else "choose another with --port or [frontend] port"
                    )
                ) from None


def preflight(profile: Profile, *, port_key: str = "frontend.port") -> None:
    """What `up` can find wrong in a second, before it creates the rings or starts the engine."""
    from blink_appliance.model.metadata import check_source_files

    fe = profile.frontend
    if fe.transport == "nixl" and profile.dpu is not None:
        from blink_appliance.wire.handshake import load_secret

        check_port(profile.dpu.listen, profile.dpu.port, "dpu.port")
        try:
            load_secret(profile.dpu.secret_file)  # the ring agent stops on a bad one: say so now
        except ValueError as e:
            raise StartupError(str(e)) from None
    else:
        check_port(fe.host, fe.port, port_key)
    for m in profile.models:
        try:
            check_source_files(m.model_source)
        except (FileNotFoundError, ValueError) as e:
            key = m.key("source") if m.source is not None else m.key("name")
            raise StartupError(f"{key}: {e}") from None


def run_up(profile: Profile, profile_path: Path, *, host: str | None, port: int | None) -> int:
    if profile.frontend.transport == "nixl" and (host is not None or port is not None):
        say(
            "--host/--port: with frontend.transport 'nixl' this host serves no HTTP; give them to "
            "`blink-appliance frontend` where the front end runs"
        )
        return 2
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
