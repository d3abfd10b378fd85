"""A fleet of appliances behind Ray Serve (docs/fleet.md): each deployment replica owns one
`blink-appliance up` with its profile, and Ray's proxy spreads the OpenAI routes over them.

The appliance never needs Ray: this module imports it only in `fleet_app` and `serve_fleet` (the
`fleet` extra). A replica relays requests and streams as they are, so the appliance's answers
(400s with OpenAI's error body, 503s with Retry-After while it drains) reach the client unchanged.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp

from blink_appliance.processes import shutdown_s, stop_child
from blink_appliance.profile import load_profile

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

# Headers about one hop of HTTP, not the message: the relay's own connections set them (and its
# server its own date and server).
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer",
     "date", "server"}
)  # fmt: skip
REPLICA_HEADER = "x-blink-replica"  # which appliance answered (its ring region's name)
# Past the appliance's own shutdown, what the replica waits before it kills it: killed sooner, its
# engines would stop under a front end still streaming.
STOP_MARGIN_S = 5.0


def replica_profile(profile_path: Path, directory: Path, tag: str) -> Path:
    """The profile with a ring region of this replica's own (two appliances on one host must not
    share one), written into `directory`."""
    import tomli_w

    data = tomllib.loads(profile_path.read_text())
    appliance = data.setdefault("appliance", {})
    appliance["shm_name"] = f"{appliance.get('shm_name', 'blink-appliance')}-{tag}"
    out = directory / f"profile-{tag}.toml"
    out.write_text(tomli_w.dumps(data))
    return out


def _die_with_parent() -> None:
    """In the child: SIGTERM when the thread that started it ends, which is when the replica's
    process dies, even by SIGKILL (Ray's last resort): an appliance never outlives its replica."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ApplianceReplica:
    """One appliance, started with the replica and stopped (drained) with it; requests are relayed."""

    def __init__(self, profile: str, ready_timeout_s: float = 900.0) -> None:
        import tempfile

        self.tag = uuid.uuid4().hex[:8]
        self._dir = tempfile.TemporaryDirectory(prefix="blink-fleet-")
        path = replica_profile(Path(profile), Path(self._dir.name), self.tag)
        appliance = load_profile(path).appliance
        self.name, self.drain_timeout_s = appliance.shm_name, appliance.drain_timeout_s
        exe = Path(sys.executable).parent / "blink-appliance"
        started = threading.Event()

        def own() -> None:
            # The death signal follows the thread that started the child: this one lives until
            # the appliance has exited (or the whole replica died).
            try:
                proc = subprocess.Popen(
                    [str(exe), "up", str(path), "--host", "127.0.0.1", "--port", "0"],
                    stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent,
                )  # fmt: skip
            except OSError as e:
                spawned.append(e)
                started.set()
                return
            spawned.append(proc)
            started.set()
            proc.wait()

        spawned: list[subprocess.Popen[str] | OSError] = []
        threading.Thread(target=own, name=f"appliance-{self.tag}", daemon=True).start()
        started.wait()
        if isinstance(spawned[0], OSError):
            raise RuntimeError(f"cannot start {exe}: {spawned[0]}")
        self.proc = spawned[0]
        self._stopping = False
        url: list[str] = []
        reader = threading.Thread(target=lambda: url.append(self.proc.stdout.readline().strip()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(ready_timeout_s)
        if not url or not url[0].startswith("http://"):
            self._stop(10.0)
            raise RuntimeError(
                f"appliance {self.name} did not come up (exit {self.proc.poll()}); see its log"
            )
        self.url = url[0]
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        if self._session is None:  # made on the replica's event loop, where requests run
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        target = self.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            upstream = await self._session.request(
                request.method, target, headers=headers, data=await request.body()
            )
        except aiohttp.ClientError as e:  # the appliance is gone or restarting: another replica may serve
            body = {"error": {"message": f"replica unavailable: {e}", "type": "service_unavailable",
                              "param": None, "code": None}}  # fmt: skip
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        out[REPLICA_HEADER] = self.name
        if upstream.content_type == "text/event-stream":

            async def relay() -> Any:
                try:
                    async for chunk in upstream.content.iter_any():
                        yield chunk
                finally:
                    if upstream.content.at_eof():
                        upstream.release()
                    else:  # the client went away: closing the upstream cancels the request there
                        upstream.close()

            return StreamingResponse(relay(), status_code=upstream.status, headers=out)
        body = await upstream.read()
        upstream.release()
        return Response(body, status_code=upstream.status, headers=out)

    def check_health(self) -> None:
        """Ray replaces a replica whose appliance exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"appliance {self.name} exited with code {self.proc.returncode}")

    def __del__(self) -> Awaitable[None] | None:
        """Ray calls this once the replica's requests have ended, on the event loop that relays them,
        and awaits what it returns: the appliance drains and stops in a thread, so a request that
        reached the replica after Ray's own drain keeps streaming meanwhile. Called by Python's
        finalizer instead (no loop running here), it stops the appliance in place."""
        if not hasattr(self, "proc") or self._stopping:
            return None
        self._stopping = True
        timeout_s = shutdown_s(self.drain_timeout_s) + STOP_MARGIN_S
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._stop(timeout_s)
            return None
        return asyncio.to_thread(self._stop, timeout_s)

    def _stop(self, timeout_s: float) -> None:
        stop_child(self.proc, timeout_s)
        self._dir.cleanup()


def fleet_app(profile: str, replicas: int, *, graceful_shutdown_timeout_s: float | None = None) -> Any:
    """The Ray Serve application: `replicas` appliances of `profile`, each owning its GPUs. A stopping
    replica's budget covers Ray's wait for its requests and then its appliance's whole shutdown."""
    from ray import serve

    p = load_profile(profile)
    gpus = len({m.device for m in p.models if m.device.startswith("cuda")})  # what one appliance owns
    deployment = serve.deployment(
        ApplianceReplica,
        name="blink-appliance",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0, "num_gpus": gpus},
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s
        or p.appliance.drain_timeout_s + shutdown_s(p.appliance.drain_timeout_s) + 30.0,
        health_check_period_s=2.0,
        max_ongoing_requests=p.frontend.max_inflight,
    )
    return deployment.bind(str(Path(profile).resolve()))


def serve_fleet(profile: str, replicas: int, host: str, port: int, address: str | None) -> int:
    """`blink-appliance fleet`: join the Ray cluster at `address` (None: start a local one), serve
    the fleet on host:port until SIGINT or SIGTERM, then stop every replica (each drains)."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(fleet_app(profile, replicas), name="blink", route_prefix="/")
    print(f"fleet of {replicas} serving on http://{host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
