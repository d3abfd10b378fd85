"""The OpenAI-compatible API over real HTTP against a live `blink-appliance up` (real rings, real engine process).

One appliance (SmolLM2-135M-Instruct, greedy unless a test says otherwise, small max_tokens) serves
the whole module; the crash test restarts its engine and runs last. Helpers here are shared with
test_http_lifecycle.py, which starts its own appliance to drain it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

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
    profile = write_profile(directory, source, **kwargs)
    log_path = directory / "appliance.log"
    log = log_path.open("w")
    exe = Path(sys.executable).parent / "blink-appliance"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("BLINK_API_KEY", None)
    proc = subprocess.Popen(
        [str(exe), "up", str(profile)], stdout=subprocess.PIPE, stderr=log, text=True, env=env
    )
    url: list[str] = []
    reader = threading.Thread(target=lambda: url.append(proc.stdout.readline().strip()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(START_TIMEOUT_S)
    app = LiveAppliance(proc, url[0] if url else "", log_path)
    if not app.url.startswith("http://"):
        app.stop(10)
        raise RuntimeError(f"appliance did not come up (exit {proc.poll()}):\n{app.log()}")
    return app


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_source(request: pytest.FixtureRequest) -> str:
    """The cached SmolLM2 GGUF when the session fixture exists, else the named model (pulled once)."""
    try:
        return f"gguf:{request.getfixturevalue('smollm2_gguf_path')}"
    except pytest.FixtureLookupError:
        return MODEL_NAME


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, smollm2_source: str):
    pytest.importorskip("blink_appliance.engine.llm_engine", reason="the CPU engine has not landed")
    app = start_appliance(tmp_path_factory.mktemp("live"), smollm2_source)
    yield app
    code = app.stop()
    assert code == 0, f"appliance exited with {code}:\n{app.log()}"


async def _post(live: LiveAppliance, path: str, body: object, *, headers: dict[str, str] | None = None):
    async with aiohttp.ClientSession(headers=live.headers if headers is None else headers) as s:
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        async with s.post(live.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text.startswith("{") else text), r.headers


async def _stream(live: LiveAppliance, path: str, body: dict) -> list[dict | str]:
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


def _chat(content: str, **kw: object) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def _completion(prompt: str, **kw: object) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, **kw}


# -- endpoints ----------------------------------------------------------------------------------


async def test_health_models_and_metrics(live):
    async with aiohttp.ClientSession() as s:
        async with s.get(live.url + "/health") as r:  # open without a key
            assert r.status == 200
            assert (await r.json())["status"] == "ok"
        async with s.get(live.url + "/v1/models", headers=live.headers) as r:
            body = await r.json()
            assert [m["id"] for m in body["data"]] == [MODEL_NAME]
        async with s.get(live.url + f"/v1/models/{MODEL_NAME}", headers=live.headers) as r:
            assert (await r.json())["id"] == MODEL_NAME
        async with s.get(live.url + "/v1/models/nope", headers=live.headers) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    await _post(live, "/v1/completions", _completion("Hello", max_tokens=3))
    async with aiohttp.ClientSession() as s:
        async with s.get(live.url + "/metrics") as r:
            text = await r.text()
    for series in (
        "blink_time_to_first_token_seconds_bucket",
        "blink_time_per_output_token_seconds_bucket",
        "blink_e2e_request_latency_seconds_count",
        "blink_prompt_tokens_total",
        "blink_generation_tokens_total",
        "blink_num_requests_running",
        "blink_num_requests_waiting",
        "blink_kv_cache_usage_ratio",
        'blink_engine_alive{model_name="smollm2-135m-instruct"} 1.0',
        'blink_engine_step_seconds_bucket{le="3.2e-05",model_name="smollm2-135m-instruct"}',
        'blink_ring_payload_waits_total{model_name="smollm2-135m-instruct"} 0.0',
    ):
        assert series in text, series
    # The engine's step-time histogram counts the steps of that completion (telemetry is periodic).
    steps = 0.0
    for _ in range(100):
        async with aiohttp.ClientSession() as s:
            async with s.get(live.url + "/metrics") as r:
                text = await r.text()
        inf = [ln for ln in text.splitlines() if ln.startswith('blink_engine_step_seconds_bucket{le="+Inf"')]
        steps = float(inf[0].rsplit(" ", 1)[1])
        if steps >= 3:
            break
        await asyncio.sleep(0.05)
    assert steps >= 3  # a prefill and two decodes at least


async def test_telemetry_route_is_served(live):
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/telemetry") as r:
            assert r.status == 200
            snap = await r.json()
    assert snap["models"][0]["name"] == MODEL_NAME


async def test_completion_greedy_usage_and_length(live):
    status, body, _ = await _post(
        live, "/v1/completions", _completion("The capital of France is", max_tokens=5, ignore_eos=True)
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    # greedy is deterministic
    _, again, _ = await _post(
        live, "/v1/completions", _completion("The capital of France is", max_tokens=5, ignore_eos=True)
    )
    assert again["choices"][0]["text"] == choice["text"]


async def test_prompt_as_token_ids_equals_text_prompt(live):
    from blink_appliance.model.loaders import load_tokenizer

    tok = load_tokenizer(_source_of(live))
    ids = tok.encode("Once upon a time", add_special_tokens=True)
    _, by_text, _ = await _post(
        live, "/v1/completions", _completion("Once upon a time", max_tokens=4, ignore_eos=True)
    )
    _, by_ids, _ = await _post(live, "/v1/completions", _completion(ids, max_tokens=4, ignore_eos=True))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def _source_of(live: LiveAppliance) -> str:
    for line in (Path(live.log_path).parent / "profile.toml").read_text().splitlines():
        if line.startswith("source = "):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError("no source in profile")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streaming_equals_non_streaming_greedy(live, path):
    body = (
        _chat("Name three colors.", max_tokens=12)
        if "chat" in path
        else _completion("1, 2, 3,", max_tokens=12)
    )
    status, whole, _ = await _post(live, path, body)
    assert status == 200, whole
    events = await _stream(live, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    if "chat" in path:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text == whole["choices"][0]["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]


async def test_stream_without_include_usage_has_no_usage_chunk(live):
    events = await _stream(live, "/v1/completions", _completion("Hi", max_tokens=3))
    assert all("usage" not in e for e in events if isinstance(e, dict))


def test_official_openai_client(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=10)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=10, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    comp = client.completions.create(
        model=MODEL_NAME, prompt="Hello, my name is", temperature=0, max_tokens=4
    )
    assert comp.choices[0].text and comp.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- parameters ---------------------------------------------------------------------------------


async def test_sampling_parameters_seeded_reproducible(live):
    body = _completion(
        "The weather today",
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        ignore_eos=True,
    )
    outs = []
    for _ in range(2):
        status, r, _ = await _post(live, "/v1/completions", body)
        assert status == 200, r
        outs.append(r["choices"][0]["text"])
    assert outs[0] == outs[1]
    assert r["usage"]["completion_tokens"] == 8


async def test_max_tokens_and_max_completion_tokens(live):
    _, r, _ = await _post(
        live, "/v1/chat/completions", _chat("Count to twenty.", max_completion_tokens=3, ignore_eos=True)
    )
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    _, r, _ = await _post(
        live, "/v1/chat/completions", _chat("Count to twenty.", max_tokens=2, ignore_eos=True)
    )
    assert r["usage"]["completion_tokens"] == 2


async def test_stop_strings_cut_the_text(live):
    base = _completion("1, 2, 3, 4, 5,", max_tokens=16, ignore_eos=True)
    _, free, _ = await _post(live, "/v1/completions", base)
    text = free["choices"][0]["text"]
    assert len(text) > 3
    stop = text[2:4]  # something greedy decoding is known to produce
    _, cut, _ = await _post(live, "/v1/completions", {**base, "stop": [stop, "never-appears"]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    events = await _stream(live, "/v1/completions", {**base, "stop": stop})
    streamed = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
    assert streamed == cut["choices"][0]["text"]


async def test_stop_token_ids_end_with_stop(live):
    from blink_appliance.model.loaders import load_tokenizer

    base = _completion("1, 2, 3, 4, 5,", max_tokens=16, ignore_eos=True)
    _, free, _ = await _post(live, "/v1/completions", {**base, "max_tokens": 3})
    tok = load_tokenizer(_source_of(live))
    prompt_ids = tok.encode("1, 2, 3, 4, 5,", add_special_tokens=True)
    full_ids = tok.encode("1, 2, 3, 4, 5," + free["choices"][0]["text"], add_special_tokens=True)
    second = full_ids[len(prompt_ids) + 1] if len(full_ids) > len(prompt_ids) + 1 else full_ids[-1]
    _, r, _ = await _post(live, "/v1/completions", {**base, "stop_token_ids": [second]})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] <= 3


async def test_chat_without_max_tokens_ends_on_eos_or_length(live):
    status, r, _ = await _post(live, "/v1/chat/completions", _chat("Say hi.", max_tokens=40))
    assert status == 200
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


# -- error paths --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"n": 2}, "n", "only n=1"),
        ({"logprobs": 2}, "logprobs", "not supported yet"),
        ({"echo": True}, "echo", "not supported yet"),
        ({"best_of": 3}, "best_of", "not supported yet"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "not supported yet"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported yet"),
        ({"temperature": -1}, "temperature", "invalid 'temperature'"),
        ({"top_p": 0}, "top_p", "invalid 'top_p'"),
        ({"max_tokens": 0}, "max_tokens", "invalid 'max_tokens'"),
        ({"max_tokens": 100000}, "max_tokens", "too large"),
        ({"frobnicate": 1}, "frobnicate", "unknown parameter"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids", "outside the vocabulary"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"prompt": "word " * 600}, "prompt", "at most"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ],
)
async def test_completion_400s(live, body, param, fragment):
    status, r, _ = await _post(live, "/v1/completions", {**_completion("Hi", max_tokens=2), **body})
    assert status == 400, r
    err = r["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ({"model": None}, "model"),
    ],
)
async def test_chat_400s(live, body, param):
    status, r, _ = await _post(live, "/v1/chat/completions", {**_chat("Hi", max_tokens=2), **body})
    assert status == 400, r
    assert r["error"]["param"] == param


async def test_other_error_statuses(live):
    status, r, _ = await _post(live, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in r["error"]["message"]
    status, r, _ = await _post(live, "/v1/completions", "[1, 2]")
    assert status == 400
    status, r, _ = await _post(live, "/v1/completions", {**_completion("x" * 70000)})
    assert status == 413 and r["error"]["code"] == "request_too_large"
    status, r, _ = await _post(live, "/v1/completions", _completion("Hi"), headers={})
    assert status == 401 and r["error"]["code"] == "invalid_api_key"
    status, r, _ = await _post(
        live, "/v1/completions", _completion("Hi"), headers={"Authorization": "Bearer nope-nope-nope"}
    )
    assert status == 401
    status, r, _ = await _post(live, "/v1/completions", {**_completion("Hi"), "model": "other"})
    assert status == 404 and r["error"]["param"] == "model"
    status, r, _ = await _post(live, "/v1/nothing-here", {})
    assert status == 404 and "error" in r
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/v1/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()


# -- cancellation, load, crash ------------------------------------------------------------------


async def _engine_counter(live: LiveAppliance, name: str) -> int:
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/metrics") as r:
            text = await r.text()
    for line in text.splitlines():
        if line.startswith(name):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def test_client_disconnect_cancels_the_request(live):
    body = _completion("Tell me a long story.", max_tokens=400, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession(headers=live.headers) as s:
        resp = await s.post(live.url + "/v1/completions", json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
            if seen >= 4:
                break
        resp.close()  # drop the connection mid-stream
    t0 = time.monotonic()
    # 400 tokens would take many seconds on this CPU; the engine must be idle again long before.
    while time.monotonic() - t0 < 10:
        if await _engine_counter(live, "blink_num_requests_running") == 0:
            break
        await asyncio.sleep(0.1)
    assert await _engine_counter(live, "blink_num_requests_running") == 0
    assert time.monotonic() - t0 < 10
    assert await _engine_counter(live, 'blink_request_success_total{finished_reason="abort"') >= 1


@pytest.mark.slow
async def test_200_concurrent_streaming_clients_all_complete(live):
    async def one(i: int) -> tuple[int, str | None, bool]:
        events = await _stream(
            live, "/v1/completions", _completion(f"Request {i}:", max_tokens=3, ignore_eos=True)
        )
        dicts = [e for e in events if isinstance(e, dict)]
        reason = next(
            (c["choices"][0]["finish_reason"] for c in dicts if c["choices"][0]["finish_reason"]), None
        )
        return i, reason, events[-1] == "[DONE]"

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=150)
    assert len(results) == 200
    assert all(reason == "length" and done for _, reason, done in results), results


async def test_dashboard_shows_live_changing_numbers(live):
    """`blink-appliance top` (headless, Textual pilot) against this appliance: numbers move after requests."""
    from blink_appliance.tui.app import BlinkDashboard
    from blink_appliance.tui.widgets import ModelPanel

    app = BlinkDashboard(live.url, api_key=API_KEY)  # the appliance has API keys: /telemetry needs one

    def total_tokens() -> int | None:
        model = app.snapshot.model(MODEL_NAME) if app.snapshot is not None else None
        return None if model is None else model.latency.total_tokens

    def panel_text() -> str:
        panel = app.query_one(ModelPanel)
        return "\n".join(str(w.render()) for w in panel.query("Static"))

    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 20
        while app.connection != "live" or total_tokens() is None:
            assert time.monotonic() < deadline, app.connection
            await pilot.pause(0.1)
        before = total_tokens()
        await asyncio.gather(
            *(_stream(live, "/v1/completions", _completion(f"Count {i}:", max_tokens=6, ignore_eos=True))
              for i in range(3))
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while total_tokens() < before + 18:
            assert time.monotonic() < deadline, (before, total_tokens())
            await pilot.pause(0.1)
        await pilot.pause(0.3)  # one more refresh, so the panel shows what the snapshot holds
        assert MODEL_NAME in (app.query_one(ModelPanel).border_title or "")
        assert f"total {total_tokens()}" in panel_text(), panel_text()


async def test_zz_engine_crash_fails_inflight_then_recovers(live):
    """Runs last in the module (name): kills the engine with SIGKILL mid-stream."""
    engine = live.child("blink_appliance.engine_process")
    body = _completion("Write a poem.", max_tokens=300, ignore_eos=True)
    streamed: list[dict | str] = []

    async def streaming() -> None:
        async with aiohttp.ClientSession(headers=live.headers) as s:
            async with s.post(live.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        payload = line[6:].decode().strip()
                        streamed.append(payload if payload == "[DONE]" else json.loads(payload))

    stream_task = asyncio.create_task(streaming())
    whole_task = asyncio.create_task(_post(live, "/v1/completions", body))
    while len(streamed) < 3:
        await asyncio.sleep(0.05)
    engine.send_signal(signal.SIGKILL)
    status, r, _ = await asyncio.wait_for(whole_task, 30)
    assert status == 503 and r["error"]["code"] == "engine_failure", r
    await asyncio.wait_for(stream_task, 30)
    assert streamed[-1] == "[DONE]"
    assert "error" in streamed[-2] and streamed[-2]["error"]["code"] == "engine_failure"
    # The daemon restarts the engine; the front end kept serving and new requests succeed.
    deadline = time.monotonic() + 180
    while True:
        status, r, _ = await _post(live, "/v1/completions", _completion("Hello", max_tokens=2))
        if status == 200:
            break
        assert status == 503, r
        assert time.monotonic() < deadline, live.log()
        await asyncio.sleep(0.5)
    assert r["usage"]["completion_tokens"] >= 1
    assert live.child("blink_appliance.engine_process").pid != engine.pid
