"""The fleet (blink_appliance/fleet.py): two CPU appliances behind Ray Serve answer as one
endpoint, driven by the `openai` client, and stopping one mid-load loses no accepted request."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the fleet extra (ray[serve]) is not installed")
serve = pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")
openai = pytest.importorskip("openai")

from blink_appliance.fleet import REPLICA_HEADER, ApplianceReplica, fleet_app, replica_profile  # noqa: E402
from tests.live_appliance import API_KEY, MODEL_NAME, write_profile  # noqa: E402

OUTPUT_TOKENS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_replica_gets_a_ring_region_of_its_own(tmp_path: Path) -> None:
    """Two appliances on one host must not share a region: a replica's profile renames it, and
    keeps every other key as written."""
    profile = write_profile(tmp_path, "dummy:tiny")
    from blink_appliance.profile import load_profile

    base, derived = load_profile(profile), load_profile(replica_profile(profile, tmp_path, "abc"))
    assert derived.appliance.shm_name == base.appliance.shm_name + "-abc"
    assert derived.model_dump(exclude={"appliance"}) == base.model_dump(exclude={"appliance"})


async def test_a_replica_whose_appliance_is_gone_refuses_with_retry_after() -> None:
    """The relay answers 503 with OpenAI's error body and Retry-After, which clients retry."""
    from starlette.requests import Request

    replica = object.__new__(ApplianceReplica)
    replica.url, replica.name, replica._session = f"http://127.0.0.1:{free_port()}", "gone", None
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "query_string": b"", "headers": []}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    response = await replica(Request(scope, receive))
    await replica._session.close()
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert b'"type":"service_unavailable"' in response.body


def _stand_in_appliance(release: Path) -> ApplianceReplica:
    """A replica whose appliance is a stand-in: on SIGTERM it drains until `release` exists, then
    exits 0."""
    code = (
        "import os, signal, sys, time\n"
        "def drain(*_):\n"
        f"    while not os.path.exists({str(release)!r}):\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, drain)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    replica = object.__new__(ApplianceReplica)
    replica.proc, replica.drain_timeout_s, replica._stopping = proc, 1.0, False
    replica._dir = tempfile.TemporaryDirectory()
    return replica


async def test_a_stopping_replica_leaves_its_event_loop_to_the_relays(tmp_path: Path) -> None:
    """Ray awaits the replica's __del__ on the loop that relays its requests: the appliance drains in a
    thread, so requests that reached the replica after Ray's drain keep streaming. Here the loop itself
    lets the stand-in appliance finish draining; a stop that blocked the loop would wait out its
    timeout, kill the appliance and return nothing to await. Python's finalizer (no loop running)
    stops it in place."""
    release = tmp_path / "release"
    replica = _stand_in_appliance(release)
    stopping = replica.__del__()
    assert stopping is not None, "__del__ stopped the appliance on the event loop"
    task = asyncio.ensure_future(stopping)
    await asyncio.sleep(0)
    release.touch()  # by the loop, while the stop is under way
    await asyncio.wait_for(task, 60.0)
    assert replica.proc.returncode == 0  # drained and exited, not killed
    assert replica.__del__() is None  # once stopped, never again

    finalized = _stand_in_appliance(release)
    assert await asyncio.to_thread(finalized.__del__) is None  # no loop in that thread: in place
    assert finalized.proc.returncode == 0


async def test_a_client_leaving_a_relayed_stream_closes_it_at_the_appliance(aiohttp_server) -> None:
    """The relay's upstream closes when its client goes away, so the appliance cancels the request."""
    from aiohttp import web
    from starlette.requests import Request

    left = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for k in range(1000):
                await response.write(f"data: {k}\n\n".encode())
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            left.set()
            raise
        return response

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post("/v1/completions", sse)
    server = await aiohttp_server(app)
    replica = object.__new__(ApplianceReplica)
    replica.url, replica.name, replica._session = str(server.make_url("")).rstrip("/"), "a", None
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": []}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    response = await replica(Request(scope, receive))
    assert response.headers[REPLICA_HEADER] == "a"
    chunks = response.body_iterator
    assert (await anext(chunks)).startswith(b"data: 0")
    await chunks.aclose()  # the client went away
    await asyncio.wait_for(left.wait(), 10)
    await replica._session.close()


@pytest.fixture
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


async def _stream(client: openai.AsyncOpenAI, k: int) -> tuple[str, list[str | None], int]:
    """One streamed completion: the replica that answered, each chunk's finish_reason, and the
    completion tokens its usage counts."""
    raw = await client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=[5 + k, 6, 7], max_tokens=OUTPUT_TOKENS, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    finishes, used = [], 0
    async for chunk in raw.parse():
        finishes += [c.finish_reason for c in chunk.choices]
        used = chunk.usage.completion_tokens if chunk.usage else used
    return raw.headers[REPLICA_HEADER], finishes, used


async def test_two_appliances_are_one_endpoint_and_stopping_one_loses_no_request(tmp_path: Path, ray_cluster):
    profile = str(write_profile(tmp_path, "dummy:tiny", drain_timeout_s=30.0))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    await asyncio.to_thread(serve.run, fleet_app(profile, 2), name="blink", route_prefix="/")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=10)

    first: list[tuple[str, list[str | None], int]] = []
    # Ray's router picks by queue lengths, so both appliances answer soon; on a loaded host its
    # probes of a replica can miss their deadline for a while (10 waves were once not enough in CI).
    deadline = time.monotonic() + 90.0
    while len({replica for replica, _, _ in first}) < 2 and time.monotonic() < deadline:
        first += await asyncio.gather(*(_stream(client, k) for k in range(12)))
    assert len({replica for replica, _, _ in first}) == 2, "Ray's proxy used one appliance only"

    # Mid-load, scale to one replica: Ray stops routing to one, waits for its requests, then its
    # appliance drains. Requests keep arriving meanwhile.
    load = [asyncio.create_task(_stream(client, k)) for k in range(24)]
    await asyncio.sleep(0.5)
    scale = asyncio.create_task(
        asyncio.to_thread(serve.run, fleet_app(profile, 1), name="blink", route_prefix="/")
    )
    late = [asyncio.create_task(_stream(client, k)) for k in range(12)]
    results = await asyncio.gather(*load, *late)
    await scale
    for _, finishes, used in first + results:
        # Exactly one terminal event per request, and every token of it.
        assert [f for f in finishes if f is not None] == ["length"] and used == OUTPUT_TOKENS
    status = serve.status().applications["blink"].deployments["blink-appliance"]
    assert status.replica_states.get("RUNNING") == 1, status
    after = await asyncio.gather(*(_stream(client, k) for k in range(4)))
    assert len({replica for replica, _, _ in after}) == 1
    await client.close()
