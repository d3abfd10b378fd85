"""bench load generator over real HTTP against small scripted servers (timing, caps, failures).

The scripted server streams OpenAI-style SSE with known pauses, so the client's chunk timestamps
can be checked against them; the live appliance is exercised in test_bench_serve_live.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from blink_appliance.bench.datasets import BenchRequest
from blink_appliance.bench.load_generator import LoadConfig, request_body, run_load
from blink_appliance.bench.serving_metrics import compute_metrics

PAUSE_S = 0.06


class ScriptedServer:
    """A completions/chat server whose behaviour each test picks; it counts concurrency."""

    def __init__(self, mode: str = "ok", *, send_usage: bool = True, first_delay_s: float = PAUSE_S) -> None:
        self.mode = mode
        self.send_usage = send_usage
        self.first_delay_s = first_delay_s
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.mode == "http_error":
            return web.json_response({"error": {"message": "the engine is busy", "code": "busy"}}, status=503)
        if not body.get("stream", False):  # one JSON response, as OpenAI's non-streamed completion
            n = body["max_tokens"]
            return web.json_response({
                "choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": n},
            })  # fmt: skip
        chat = request.path.endswith("chat/completions")
        n = body.get("max_completion_tokens" if chat else "max_tokens")
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: object) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            if chat:  # a role-only first chunk: no text, so it must not count as the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            await asyncio.sleep(self.first_delay_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(PAUSE_S)
                if self.mode == "stream_error" and i == 1:
                    await send({"error": {"message": "engine failed", "code": "engine_failure"}})
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                if self.mode == "cut" and i == 1:
                    return resp  # the connection ends without [DONE]
                piece = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
                finish = "length" if i == n - 1 else None
                await send({"choices": [{"index": 0, **piece, "finish_reason": finish}]})
            if self.send_usage:
                await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.inflight -= 1


async def _serve(script: ScriptedServer) -> TestServer:
    app = web.Application()
    app.router.add_post("/v1/completions", script.handle)
    app.router.add_post("/v1/chat/completions", script.handle)
    server = TestServer(app)
    await server.start_server()
    return server


def _requests(n: int, out: int = 3) -> list[BenchRequest]:
    return [BenchRequest(f"prompt {i}", 7, out) for i in range(n)]


async def test_chunk_timestamps_give_ttft_itl_and_usage():
    script = ScriptedServer()
    server = await _serve(script)
    try:
        config = LoadConfig(base_url=str(server.make_url("/")), model="m", api_key="k-123")
        run = await run_load(_requests(2, out=4), config)
    finally:
        await server.close()
    assert all(r.ok and r.error is None for r in run.records)
    body = script.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert script.auth == ["Bearer k-123"] * 2
    for r in run.records:
        assert r.usage_reported and r.completion_tokens == 4 and r.prompt_tokens == 7
        assert len(r.chunk_times_s) == 4 and r.finish_reason == "length"
        assert r.ttft_s >= PAUSE_S * 0.9
        assert all(PAUSE_S * 0.9 <= gap < 1.0 for gap in r.itls_s)  # (a busy runner may add delay)
        assert r.e2e_s >= r.ttft_s + 3 * PAUSE_S * 0.9
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 3)
    m = compute_metrics(run)
    assert m.completed == 2 and m.total_output_tokens == 8 and m.itl_ms.count == 6
    assert m.itl_ms.p50 >= PAUSE_S * 900


async def test_chat_role_chunk_is_not_the_first_token_and_no_usage_counts_chunks():
    script = ScriptedServer(send_usage=False, first_delay_s=0.2)
    server = await _serve(script)
    try:
        config = LoadConfig(base_url=str(server.make_url("/")), model="m", endpoint="/v1/chat/completions")
        run = await run_load(_requests(1, out=3), config)
    finally:
        await server.close()
    (r,) = run.records
    body = script.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "prompt 0"}]
    assert body["max_completion_tokens"] == 3 and "max_tokens" not in body
    assert r.ok and not r.usage_reported and r.output_tokens == 3
    assert r.ttft_s >= 0.2 * 0.9  # the role chunk came at once; the first text after 0.2 s
    assert not compute_metrics(run).output_tokens_from_usage


async def test_concurrency_cap_holds_requests_at_the_client():
    script = ScriptedServer()
    server = await _serve(script)
    try:
        config = LoadConfig(base_url=str(server.make_url("/")), model="m", max_concurrency=2)
        run = await run_load(_requests(6, out=2), config)
    finally:
        await server.close()
    assert all(r.ok for r in run.records)
    assert script.max_inflight == 2
    # Each request's connect (new, or reused by the later ones), send and reply, in order.
    for r in run.records:
        assert 0 < r.start_s <= r.connected_s <= r.sent_s <= r.headers_s <= r.chunk_times_s[0], r
    # Released at once (rate inf) but sent as slots freed: the last ones waited two rounds.
    last_start = max(r.start_s for r in run.records)
    assert last_start > 2 * 2 * PAUSE_S
    assert max(r.scheduled_s for r in run.records) < last_start - 2 * PAUSE_S


async def test_fixed_rate_releases_on_schedule():
    script = ScriptedServer(first_delay_s=0.0)
    server = await _serve(script)
    try:
        config = LoadConfig(
            base_url=str(server.make_url("/")), model="m", request_rate=10.0, arrivals="fixed"
        )
        run = await run_load(_requests(4, out=1), config)
    finally:
        await server.close()
    starts = [r.start_s for r in run.records]
    for i, s in enumerate(starts):
        assert i * 0.1 - 0.005 <= s < i * 0.1 + 0.15, starts  # never early; late only by loop delay
    assert run.duration_s >= 0.3


@pytest.mark.parametrize(
    "mode, fragment",
    [
        ("http_error", "HTTP 503: the engine is busy"),
        ("stream_error", "stream error: engine failed"),
        ("cut", "without [DONE]"),
    ],
)
async def test_server_failures_become_failed_records(mode, fragment):
    script = ScriptedServer(mode)
    server = await _serve(script)
    try:
        run = await run_load(_requests(3), LoadConfig(base_url=str(server.make_url("/")), model="m"))
    finally:
        await server.close()
    assert [r.ok for r in run.records] == [False] * 3
    assert all(fragment in r.error for r in run.records), run.records[0].error
    m = compute_metrics(run)
    assert m.completed == 0 and m.failed == 3 and list(m.failure_reasons.values()) == [3]
    assert m.ttft_ms.count == 0 and m.request_throughput == 0.0


async def test_refused_connection_and_timeout_are_failures():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = await run_load(_requests(2), LoadConfig(base_url=f"http://127.0.0.1:{port}", model="m"))
    assert all(not r.ok and "Cannot connect" in r.error for r in run.records)

    script = ScriptedServer(first_delay_s=2.0)
    server = await _serve(script)
    try:
        config = LoadConfig(base_url=str(server.make_url("/")), model="m", request_timeout_s=0.3)
        run = await run_load(_requests(1), config)
    finally:
        await server.close()
    (r,) = run.records
    assert not r.ok and "Timeout" in r.error and r.end_s - r.start_s < 1.5


def test_config_refusals():
    with pytest.raises(ValueError, match="--endpoint"):
        LoadConfig(base_url="http://x", model="m", endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="--arrivals"):
        LoadConfig(base_url="http://x", model="m", arrivals="bursty")
    with pytest.raises(ValueError, match="rate"):
        LoadConfig(base_url="http://x", model="m", request_rate=0)
    with pytest.raises(ValueError, match="--max-concurrency"):
        LoadConfig(base_url="http://x", model="m", max_concurrency=0)
    assert LoadConfig(base_url="http://x/", model="m").url == "http://x/v1/completions"
    assert math.isinf(LoadConfig(base_url="http://x", model="m").request_rate)


async def test_token_id_prompts_are_refused_on_chat_before_sending():
    config = LoadConfig(base_url="http://127.0.0.1:9", model="m", endpoint="/v1/chat/completions")
    with pytest.raises(ValueError, match="/v1/completions"):
        await run_load([BenchRequest([1, 2, 3], 3, 2)], config)


def test_top_p_is_sent_only_when_set():
    req = BenchRequest([5, 6, 7], 3, 4)
    assert "top_p" not in request_body(LoadConfig(base_url="http://x", model="m"), req)
    body = request_body(LoadConfig(base_url="http://x", model="m", temperature=0.7, top_p=0.9), req)
    assert body["top_p"] == 0.9 and body["temperature"] == 0.7 and body["prompt"] == [5, 6, 7]


async def test_a_non_streamed_request_counts_its_tokens_from_usage_and_sends_its_priority():
    script = ScriptedServer()
    server = await _serve(script)
    try:
        config = LoadConfig(base_url=str(server.make_url("/")), model="m", stream=False, priority=3)
        run = await run_load(_requests(2, out=5), config)
    finally:
        await server.close()
    assert all(r.ok and r.completion_tokens == 5 and r.finish_reason == "length" for r in run.records)
    assert [b["priority"] for b in script.bodies] == [3, 3]
    assert all(b["stream"] is False and "stream_options" not in b for b in script.bodies)
    assert "priority" not in request_body(LoadConfig(base_url="http://x", model="m"), _requests(1)[0])
