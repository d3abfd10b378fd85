"""The front end off the host (issue 23), live: `blink-appliance up` with frontend.transport "nixl"
starts the engine and its ring agent; `blink-appliance frontend` runs in a network namespace of its
own (a veth pair stands for the link to a DPU; as root, where `ip netns` works) or else in its own
process over TCP loopback, and serves the default profile's model through NIXL to the official
openai client. Either side killed and restarted: each accepted request ends with exactly one terminal
event, and the pair serves again. The tests share one pair and run in file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from tests.live_appliance import (
    API_KEY,
    MODEL_NAME,
    LiveAppliance,
    completion_request,
    start_profile,
)
from tests.test_http_live_faults import _open_streams, _served_again, _terminal

pytest.importorskip("nixl_cu12", reason="the NIXL front end needs nixl-cu12 (the dev extra installs it)")

EXE = str(Path(sys.executable).parent / "blink-appliance")
FRONTEND_START_S = 120.0


@dataclass
class Namespace:
    """Where the front end runs: a netns behind a veth pair, or (None) this host's loopback."""

    name: str | None
    engine_ip: str
    frontend_ip: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv] if self.name else argv


def _make_namespace() -> Namespace:
    """A netns and veth pair when this process may (root, `ip netns`), else loopback (also with
    BLINK_TEST_NETNS=0, to run that variant where a netns would work)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or os.environ.get("BLINK_TEST_NETNS") == "0":
        return Namespace(None, "127.0.0.1", "127.0.0.1")
    k = os.getpid() % 200 + 20
    ns, host_if, ns_if = f"blinkfe{k}", f"bvh{k}", f"bvf{k}"
    engine_ip, frontend_ip = f"10.213.{k}.1", f"10.213.{k}.2"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{engine_ip}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{frontend_ip}/24", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    for step in steps:
        if subprocess.run(step, capture_output=True, check=False).returncode != 0:
            _remove_namespace(ns, host_if)
            return Namespace(None, "127.0.0.1", "127.0.0.1")  # a container without NET_ADMIN
    return Namespace(ns, engine_ip, frontend_ip)


def _remove_namespace(ns: str | None, host_if: str | None = None) -> None:
    if ns is None:
        return
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    if host_if:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def write_nixl_profile(directory: Path, source: str, net: Namespace) -> Path:
    secret = directory / "dpu.secret"
    secret.write_text(os.urandom(32).hex())
    path = directory / "profile.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [appliance]
            shm_name = "blink-nixl-{os.getpid()}"
            engine_restarts = 5

            [[models]]
            name = "{MODEL_NAME}"
            source = "{source}"
            max_seqs = 32
            max_model_len = 512
            kv_budget_gib = 0.25

            [frontend]
            host = "{net.frontend_ip}"
            port = 0
            transport = "nixl"
            max_inflight = 64
            api_keys = ["{API_KEY}"]

            [dpu]
            frontend_host = "{net.frontend_ip}"
            listen = "{net.engine_ip}"
            port = {_free_port(net.engine_ip)}
            secret_file = "{secret}"
            connect_timeout_s = 3
            {"" if net.name else 'ucx_transports = ["tcp"]  # on one host UCX would pick shared memory'}
            """
        )
    )
    return path


class RemoteFrontend:
    """`blink-appliance frontend PROFILE` in the namespace, and the URL it serves."""

    def __init__(
        self, directory: Path, profile: Path, net: Namespace, env: dict[str, str] | None = None
    ) -> None:
        self.ready = directory / f"frontend-{time.monotonic_ns()}.url"
        self.log_path = directory / f"{self.ready.stem}.log"
        argv = net.command([EXE, "frontend", str(profile), "--ready-file", str(self.ready)])
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, **(env or {})})
        self.url = ""

    def wait_ready(self) -> str:
        deadline = time.monotonic() + FRONTEND_START_S
        while not self.ready.exists():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)
        self.url = self.ready.read_text().strip()
        return self.url

    def server(self) -> psutil.Process:
        """The front end's Python process (under `ip netns exec`, which execs it: the same pid)."""
        return psutil.Process(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Pair:
    directory: Path
    profile: Path
    net: Namespace
    engine_host: LiveAppliance
    frontend: RemoteFrontend

    @property
    def live(self) -> LiveAppliance:
        """The front end's URL and the engine host's log, as the HTTP helpers want them."""
        return LiveAppliance(self.engine_host.proc, self.frontend.url, self.engine_host.log_path)

    def log(self) -> str:
        return self.engine_host.log() + "\n--- front end ---\n" + self.frontend.log()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, smollm2_source: str):
    directory = tmp_path_factory.mktemp("nixl")
    net = _make_namespace()
    profile = write_nixl_profile(directory, smollm2_source, net)
    pair = Pair(directory, profile, net, start_profile(directory, profile), None)  # type: ignore[arg-type]
    try:
        pair.frontend = RemoteFrontend(directory, profile, net)
        pair.frontend.wait_ready()
        yield pair
    finally:  # the tests replace either side: stop the ones running now
        if pair.frontend is not None:
            pair.frontend.stop()
        pair.engine_host.stop()
        _remove_namespace(net.name, f"bvh{net.name[7:]}" if net.name else None)


def test_the_openai_client_is_served_through_nixl(pair):
    assert pair.engine_host.url.startswith("nixl://") and "ring agent" in pair.engine_host.log()
    assert "linked to ring agent" in pair.frontend.log()
    client = openai.OpenAI(base_url=pair.frontend.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=12)
    assert whole.choices[0].message.content and whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=12, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == whole.choices[0].message.content
    )


async def test_the_ring_agent_killed_mid_stream_ends_each_stream_once_and_serves_again(pair):
    agent = pair.engine_host.child("blink_appliance.ring_agent")
    body = completion_request("Write a long story.", max_tokens=400, ignore_eos=True)
    tasks, streams = await _open_streams(pair.live, 3, body)
    agent.send_signal(signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for events in streams:
        error = _terminal(events)["error"]
        assert error["code"] == "engine_failure" and "link to the engine host" in error["message"], error
    assert (await _served_again(pair.live, 60))["usage"]["completion_tokens"] >= 1, pair.log()
    assert pair.engine_host.child("blink_appliance.ring_agent").pid != agent.pid
    assert pair.frontend.proc.poll() is None


async def test_the_front_end_killed_and_a_new_one_serves_and_remote_garbage_is_refused(pair):
    """SIGKILL of the front end mid-stream; while none runs, a malformed record is written through
    NIXL (it is refused and the engine keeps serving); a new front end takes the rings and serves."""
    body = completion_request("Write a poem.", max_tokens=400, ignore_eos=True)
    tasks, _ = await _open_streams(pair.live, 2, body)
    pair.frontend.server().send_signal(signal.SIGKILL)
    pair.frontend.proc.wait(30)
    await asyncio.gather(*tasks, return_exceptions=True)  # their connections simply end
    unaddressable_before, after = await asyncio.to_thread(_write_malformed_record, pair)
    assert after["records_unaddressable"] == unaddressable_before + 1, after
    pair.frontend = RemoteFrontend(pair.directory, pair.profile, pair.net)
    await asyncio.to_thread(pair.frontend.wait_ready)
    assert (await _served_again(pair.live, 60))["usage"]["completion_tokens"] >= 1, pair.log()
    # The two orphans were cancelled by the new front end (or taken back by the engine's timeout).
    deadline = time.monotonic() + 30
    while (await _health(pair))["inflight"] or (await _engine_running(pair)):
        assert time.monotonic() < deadline, pair.log()
        await asyncio.sleep(0.2)


def test_a_front_end_without_the_secret_is_refused_and_says_so(pair):
    wrong = RemoteFrontend(pair.directory, pair.profile, pair.net, env={"BLINK_DPU_SECRET": "w" * 40})
    assert wrong.proc.wait(60) == 2
    assert "dpu.secret_file" in wrong.log() and "refused us" in wrong.log(), wrong.log()
    assert "failed the shared-secret proof" in pair.engine_host.log()


async def test_zz_the_engine_host_restarted_the_front_end_links_again(pair):
    """The whole engine host side stops (`up` drains: the engine ends what it held) and starts again
    with new regions and a new agent; the same front end process reconnects and serves."""
    body = completion_request("Write a poem.", max_tokens=400, ignore_eos=True)
    tasks, streams = await _open_streams(pair.live, 2, body)
    assert pair.engine_host.stop() == 0, pair.engine_host.log()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for events in streams:
        assert "error" in _terminal(events), events[-2]
    pair.engine_host = start_profile(pair.directory, pair.profile)
    assert (await _served_again(pair.live, 90))["usage"]["completion_tokens"] >= 1, pair.log()
    assert pair.frontend.proc.poll() is None


# -- helpers -----------------------------------------------------------------------------------------


def _write_malformed_record(pair: Pair) -> tuple[int, dict[str, int]]:
    """As a rogue front end that knows the secret (tests/nixl_rogue_writer.py, a process of its own):
    one record naming a channel that does not exist, published through NIXL. Returns the unaddressable
    count before, and the telemetry after."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("nixl_rogue_writer.py")), str(pair.profile), MODEL_NAME],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + pair.log()
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["engine_state"] == "RUNNING", result
    return result["before"], result["after"]


async def _health(pair: Pair) -> dict:
    async with aiohttp.ClientSession() as s, s.get(pair.frontend.url + "/health") as r:
        return await r.json()


async def _engine_running(pair: Pair) -> int:
    async with (
        aiohttp.ClientSession(headers=pair.live.headers) as s,
        s.get(pair.frontend.url + "/metrics") as r,
    ):
        text = await r.text()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("blink_num_requests_running")
    )
