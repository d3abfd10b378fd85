"""The real front-end process serving a profile of two models (issue 21): each model has its own
ring region with its own engine (a CounterEngine behind the reference ring server, in a thread of
this test), and every request goes to the engine of the model it names."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from blink_appliance.frontend.metrics import MetricsRegistry, ServingMetrics

from blink_appliance.profile import Profile, load_profile, region_name, ring_geometry
from tests.ring_support import CounterEngine, expected_events, server_thread, shm_region, unique_name

MODELS = ("alpha", "beta")


def write_profile(tmp_path: Path) -> Path:
    """Two dummy:tiny models (token-id prompts, no tokenizer to fetch) on the CPU, any free port."""
    models = "".join(
        f'[[models]]\nname = "{name}"\nsource = "dummy:tiny"\ndevice = "cpu"\nmax_seqs = 4\n'
        f"max_model_len = {64 * (i + 1)}\nmax_num_batched_tokens = 64\nkv_budget_gib = 0.01\n\n"
        for i, name in enumerate(MODELS)
    )
    path = tmp_path / "two.toml"
    path.write_text(
        f'[appliance]\nshm_name = "{unique_name()}"\ndrain_timeout_s = 10\n\n{models}'
        '[frontend]\nhost = "127.0.0.1"\nport = 0\nmax_inflight = 8\n\n[telemetry]\ninterval_s = 0.1\n'
    )
    return path


@dataclass
class FrontEnd:
    url: str
    proc: subprocess.Popen[str]
    engines: dict[str, CounterEngine]
    # Each model's engine server; closing one stops that engine alone.
    servers: dict[str, contextlib.ExitStack] = field(default_factory=dict)


def start_front_end(profile_path: Path, ready: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "blink_appliance.frontend", str(profile_path), "--ready-file", str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(proc: subprocess.Popen[str], ready: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"front end exited with {proc.returncode}:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "front end not ready"
        time.sleep(0.02)
    return ready.read_text()


@contextlib.contextmanager
def regions_with_engines(profile: Profile, count: int) -> Iterator[tuple[dict, dict]]:
    """The first `count` models' regions, each with a CounterEngine serving it."""
    engines: dict[str, CounterEngine] = {}
    servers: dict[str, contextlib.ExitStack] = {}
    with contextlib.ExitStack() as outer:
        for i, m in enumerate(profile.models[:count]):
            geometry = ring_geometry(profile, i)
            transport = outer.enter_context(shm_region(geometry, region_name(profile, i)))
            engines[m.name] = CounterEngine(max_running=4)
            servers[m.name] = outer.enter_context(contextlib.ExitStack())
            servers[m.name].enter_context(server_thread(engines[m.name], transport, geometry))
        yield engines, servers


@contextlib.contextmanager
def running_front_end(profile_path: Path, ready: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The front-end process on the profile, once ready: its URL and process. On the way out it gets
    SIGTERM (unless it exited) and must exit 0."""
    proc = start_front_end(profile_path, ready)
    try:
        url = wait_ready(proc, ready)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log = proc.stdout.read()  # type: ignore[union-attr]
        assert code == 0, log


@pytest.fixture
def front_end(tmp_path: Path) -> Iterator[FrontEnd]:
    profile_path = write_profile(tmp_path)
    profile = load_profile(profile_path)
    with regions_with_engines(profile, len(MODELS)) as (engines, servers):
        with running_front_end(profile_path, tmp_path / "ready") as (url, proc):
            yield FrontEnd(url, proc, engines, servers)


async def test_each_request_goes_to_the_engine_of_the_model_it_names(front_end: FrontEnd) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            front_end.url + "/v1/completions",
            json={"model": "alpha", "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0},
        )
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["model"] == "alpha"
        assert body["choices"][0]["text"] == "".join(f" {t}" for t in expected_events([7, 8, 9], 4))
        assert len(front_end.engines["alpha"].added) == 1 and not front_end.engines["beta"].added

        body = {"model": "beta", "prompt": [40, 41], "max_tokens": 3, "temperature": 0, "stream": True}
        async with s.post(front_end.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            events = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == b"[DONE]" and {c["model"] for c in chunks} == {"beta"}
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == "".join(f" {t}" for t in expected_events([40, 41], 3))
        assert len(front_end.engines["beta"].added) == 1 and len(front_end.engines["alpha"].added) == 1

        # Each model keeps its own limits: beta's ring takes a prompt longer than alpha's can.
        long_prompt = {"prompt": list(range(3, 103)), "max_tokens": 1, "temperature": 0}
        r = await s.post(front_end.url + "/v1/completions", json={"model": "alpha", **long_prompt})
        assert r.status == 400, await r.text()
        r = await s.post(front_end.url + "/v1/completions", json={"model": "beta", **long_prompt})
        assert r.status == 200, await r.text()


async def test_unknown_model_is_a_404_and_models_lists_both(front_end: FrontEnd) -> None:
    async with aiohttp.ClientSession() as s:
        for path, payload in (
            ("/v1/completions", {"model": "gamma", "prompt": [5]}),
            ("/v1/chat/completions", {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = await s.post(front_end.url + path, json=payload)
            assert r.status == 404
            assert await r.json() == {
                "error": {
                    "message": "the model 'gamma' does not exist; this appliance serves 'alpha', 'beta'",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }
        r = await s.get(front_end.url + "/v1/models")
        listed = await r.json()
        assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == list(MODELS)
        for name in MODELS:
            r = await s.get(front_end.url + f"/v1/models/{name}")
            assert r.status == 200 and (await r.json())["id"] == name
        r = await s.get(front_end.url + "/v1/models/gamma")
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert not front_end.engines["alpha"].added and not front_end.engines["beta"].added


async def test_metrics_carry_each_models_label_in_one_registry(front_end: FrontEnd) -> None:
    async with aiohttp.ClientSession() as s:
        for name, n in (("alpha", 2), ("beta", 5)):
            r = await s.post(
                front_end.url + "/v1/completions",
                json={
                    "model": name,
                    "prompt": [11, 12],
                    "max_tokens": n,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status == 200, await r.text()
        text = await (await s.get(front_end.url + "/metrics")).text()
    tokens = {name: len(expected_events([11, 12], n)) for name, n in (("alpha", 2), ("beta", 5))}
    for name in MODELS:
        assert f'blink_generation_tokens_total{{model_name="{name}"}} {float(tokens[name])}' in text
        assert f'blink_prompt_tokens_total{{model_name="{name}"}} 2.0' in text
        assert f'blink_engine_alive{{model_name="{name}"}} 1.0' in text
        assert f'blink_kv_cache_usage_ratio{{model_name="{name}"}}' in text
        # Issue 22: latencies also carry the request's priority class (the model default, 0, here).
        assert f'blink_time_to_first_token_seconds_count{{model_name="{name}",priority="0"}} 1.0' in text
    # One family per metric however many models: a repeated TYPE line is invalid exposition text.
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    assert sum(line.startswith("# TYPE blink_engine_alive ") for line in types) == 1


async def test_health_is_ok_only_while_every_engine_is_alive(front_end: FrontEnd) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.get(front_end.url + "/health")
        assert r.status == 200
        assert await r.json() == {
            "status": "ok",
            "inflight": 0,
            "models": [
                {"name": "alpha", "status": "ok", "inflight": 0},
                {"name": "beta", "status": "ok", "inflight": 0},
            ],
        }
        front_end.servers["beta"].close()  # beta's engine stops; alpha's runs on
        deadline = time.monotonic() + 10
        while (r := await s.get(front_end.url + "/health")).status == 200:
            assert time.monotonic() < deadline, "health still ok with beta's engine stopped"
        body = await r.json()
        assert r.status == 503 and body["status"] == "engine_unavailable"
        assert [(m["name"], m["status"]) for m in body["models"]] == [
            ("alpha", "ok"),
            ("beta", "engine_unavailable"),
        ]
        # alpha still serves.
        r = await s.post(
            front_end.url + "/v1/completions", json={"model": "alpha", "prompt": [9], "max_tokens": 2}
        )
        assert r.status == 200, await r.text()


async def test_telemetry_reports_each_models_engine(front_end: FrontEnd) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.get(front_end.url + "/telemetry")
        snapshot = await r.json()
    assert [m["name"] for m in snapshot["models"]] == list(MODELS)
    for m in snapshot["models"]:
        assert m["engine"]["device"] == "cpu" and m["engine"]["kv_blocks_total"] is not None
        assert m["sm_share"] is None  # CPU engines have no SMs


def test_start_up_fails_naming_the_region_that_cannot_be_opened(tmp_path: Path) -> None:
    profile_path = write_profile(tmp_path)
    profile = load_profile(profile_path)
    with regions_with_engines(profile, 1):  # alpha's region and engine only
        proc = start_front_end(profile_path, tmp_path / "ready")
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert f"models[1] (beta): cannot open its ring region '{region_name(profile, 1)}'" in out
    assert "does not exist" in out and not (tmp_path / "ready").exists()


def test_two_models_metrics_share_one_registry() -> None:
    registry = MetricsRegistry()
    alive = {"alpha": True, "beta": False}
    metrics = {
        name: ServingMetrics(
            name,
            engine_telemetry=lambda n=i: {"running": n, "kv_blocks_used": n, "kv_blocks_total": 4},
            engine_alive=lambda name=name: alive[name],
            registry=registry,
        )
        for i, name in enumerate(MODELS)
    }
    metrics["beta"].request_timer(7).finish("stop")
    metrics["alpha"].error("busy")
    text = metrics["alpha"].render().decode()
    assert text == registry.render().decode()  # any model's render is the whole registry
    assert 'blink_engine_alive{model_name="alpha"} 1.0' in text
    assert 'blink_engine_alive{model_name="beta"} 0.0' in text
    assert 'blink_num_requests_running{model_name="beta"} 1.0' in text
    assert 'blink_kv_cache_usage_ratio{model_name="alpha"} 0.0' in text
    assert 'blink_prompt_tokens_total{model_name="beta"} 7.0' in text
    # Request counters carry the priority class too (issue 22); token counters stay per model.
    assert 'blink_request_success_total{finished_reason="stop",model_name="beta",priority="0"} 1.0' in text
    assert 'blink_request_errors_total{cause="busy",model_name="alpha",priority="0"} 1.0' in text
    with pytest.raises(ValueError, match="'alpha' already has metrics"):
        ServingMetrics("alpha", engine_telemetry=dict, engine_alive=lambda: True, registry=registry)
