"""A live `blink-appliance up` for tests over real HTTP (real rings, real engine process), and the
request helpers they share: tests/conftest.py's `live` fixture starts one per test module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

MODEL_NAME = "smollm2-135m-instruct"
API_KEY = "test-key-0123456789"
START_TIMEOUT_S = 240.0


@dataclass
class LiveAppliance:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def child(self, module: str) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children():
            if module in " ".join(child.cmdline()):
                return child
        raise AssertionError(f"no child process running {module}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def shm_name(self) -> str:
        """The name of its ring region (the profile's [appliance] shm_name)."""
        from blink_appliance.profile import load_profile

        return load_profile(self.log_path.parent / "profile.toml").appliance.shm_name

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    child.kill()
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def write_profile(directory: Path, source: str, *, drain_timeout_s: float = 20.0) -> Path:
    # The stall limit is raised: CI hosts are crowded (two cores, other workers, --interfere runs),
    # which can hold a healthy CPU engine's heartbeat for 10 s; tests of the limit set their own.
    path = directory / "profile.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [appliance]
            shm_name = "blink-test-{os.getpid()}-{directory.name[-12:]}"
            drain_timeout_s = {drain_timeout_s}
            engine_restarts = 3

            [[models]]
            name = "{MODEL_NAME}"
            source = "{source}"
            dtype = "float32"
            max_seqs = 64
            max_model_len = 512
            max_num_batched_tokens = 512
            kv_budget_gib = 0.25

            [engine]
            stall_limit_s = 60.0

            [frontend]
            host = "127.0.0.1"
            port = 0
            max_request_bytes = 65536
            max_inflight = 256
            api_keys = ["{API_KEY}"]

            [telemetry]
            enabled = true
            interval_s = 0.5
            """
        )
    )
    return path


def start_appliance(directory: Path, source: str, **kwargs: object) -> LiveAppliance:
    return start_profile(directory, write_profile(directory, source, **kwargs))


def start_profile(directory: Path, profile: Path) -> LiveAppliance:
    """`blink-appliance up PROFILE` until it prints its URL (the daemon does once everything serves)."""
    log_path = directory / "appliance.log"
    exe = Path(sys.executable).parent / "blink-appliance"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("BLINK_API_KEY", None)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(exe), "up", str(profile)], stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
    url: list[str] = []
    reader = threading.Thread(target=lambda: url.append(proc.stdout.readline().strip()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(START_TIMEOUT_S)
    app = LiveAppliance(proc, url[0] if url else "", log_path)
    if not app.url.startswith(("http://", "nixl://")):  # nixl: the ring agent's address, no HTTP here
        app.stop(10)
        raise RuntimeError(f"appliance did not come up (exit {proc.poll()}):\n{app.log()}")
    return app


async def post_json(live: LiveAppliance, path: str, body: object, *, headers: dict[str, str] | None = None):
    async with aiohttp.ClientSession(headers=live.headers if headers is None else headers) as s:
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        async with s.post(live.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text.startswith("{") else text), r.headers


async def stream_events(live: LiveAppliance, path: str, body: dict) -> list[dict | str]:
    """Every SSE `data:` payload of a streaming request, parsed ("[DONE]" kept as a string)."""
    out: list[dict | str] = []
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.post(live.url + path, json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_request(content: str, **kw: object) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def completion_request(prompt: str, **kw: object) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, **kw}
