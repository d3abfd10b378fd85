"""The load: requests sent on an arrival schedule under a concurrency cap, each streamed and timed.

Arrivals are scheduled up front from the seed (Poisson: exponential gaps at the mean rate; fixed:
equal gaps; rate inf: all at time 0), independent of how fast the server answers, as in an open
system. A concurrency cap holds requests at the client until a slot frees (their clock starts
when they are sent, as `vllm bench serve` counts).

Every request streams (`stream: true`, `stream_options.include_usage`) over aiohttp; the client
stamps each SSE chunk that carries output text with `time.perf_counter()` when its line arrives.
Output tokens are the server's `usage.completion_tokens` when it reports usage, else the number
of text chunks (`usage_reported` says which). A request that fails (HTTP error, an `error`
event, a stream that ends without `[DONE]`, a refused connection, a timeout) becomes a failed
record with the reason; it never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from blink_appliance.bench.datasets import BenchRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ARRIVALS = ("poisson", "fixed")


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    request_rate: float = math.inf  # requests per second; inf sends everything at once
    arrivals: str = "poisson"
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float | None = None  # None: not sent (the server's default, 1.0 in the OpenAI API)
    top_k: int | None = None  # vLLM's extension; None: not sent
    request_timeout_s: float = 600.0
    priority: int | None = None  # vLLM's extension, lower runs first; None: not sent
    stream: bool = True  # False: one JSON response (no per-token times; tokens from usage)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are perf_counter seconds from the run's start."""

    index: int
    output_len_requested: int
    input_len_expected: int | None
    scheduled_s: float = 0.0  # when the arrival schedule released it
    start_s: float = 0.0  # when it was sent (after waiting for a concurrency slot)
    connected_s: float = 0.0  # when it had a connection (a new one made, or a pooled one taken)
    sent_s: float = 0.0  # when its body was written to the connection
    headers_s: float = 0.0  # when the response's status and headers arrived (a stream's: once admitted)
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # each SSE chunk carrying output text
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    usage_reported: bool = False

    @property
    def output_tokens(self) -> int:
        """The server's count when it gave one, else the text chunks seen."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.ok and self.chunk_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.start_s if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        ttft, e2e, n = self.ttft_s, self.e2e_s, self.output_tokens
        if ttft is None or e2e is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)] if self.ok else []


@dataclass
class LoadRun:
    records: list[RequestRecord]
    duration_s: float  # from the first release to the last answer
    started_unix: float


def arrival_offsets(count: int, rate: float, arrivals: str, rng: random.Random) -> list[float]:
    """Release times (seconds from the start) of `count` requests; the first goes at 0."""
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    offsets = [0.0]
    for _ in range(count - 1):
        gap = rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
        offsets.append(offsets[-1] + gap)
    return offsets


def request_body(config: LoadConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "temperature": config.temperature,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.is_chat:
        if req.is_token_ids:
            raise ValueError("token-id prompts (--dataset random) need --endpoint /v1/completions")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if config.top_p is not None:
        body["top_p"] = config.top_p
    if config.top_k is not None:
        body["top_k"] = config.top_k
    if config.ignore_eos:
        body["ignore_eos"] = True  # a vLLM-style extension: output lengths exactly as asked
    if config.priority is not None:
        body["priority"] = config.priority
    return body


def _error_text(status: int, text: str) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip()
    return f"HTTP {status}: {message[:300]}"


def _chunk_text(chunk: dict[str, Any], is_chat: bool) -> tuple[str, str | None]:
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    if is_chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason")


def _whole_response(record: RequestRecord, body: Any, now: float) -> RequestRecord:
    """A non-streamed response: its usage gives the token counts; it has no per-token times."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices:
        record.error = f"unexpected response: {str(body)[:100]}"
        return record
    record.finish_reason = choices[0].get("finish_reason")
    usage = body.get("usage") or {}
    record.usage_reported = bool(usage)
    record.prompt_tokens, record.completion_tokens = (
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )
    record.end_s, record.ok = now, True
    return record


@dataclass
class _Stamps:
    """What the session's trace hooks stamp for one request (`_trace_config`)."""

    record: RequestRecord
    t0: float


def _trace_config() -> Any:
    """aiohttp hooks that stamp a request's connection and the end of its body into its record, so a
    slow first token can be split into the client's connect and send and the server's reply."""
    import aiohttp

    def stamp(field_name: str):
        async def hook(session: Any, ctx: Any, params: Any) -> None:
            s = ctx.trace_request_ctx
            if isinstance(s, _Stamps):
                setattr(s.record, field_name, time.perf_counter() - s.t0)

        return hook

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(stamp("connected_s"))
    trace.on_connection_reuseconn.append(stamp("connected_s"))
    trace.on_request_chunk_sent.append(stamp("sent_s"))  # the JSON body: the last write counts
    return trace


async def send_one(
    session: Any, config: LoadConfig, req: BenchRequest, record: RequestRecord, t0: float
) -> RequestRecord:
    """Stream one request into `record` (times relative to `t0`). Never raises for server faults."""
    import aiohttp

    body = request_body(config, req)
    clock = time.perf_counter
    record.start_s = clock() - t0
    done = False
    try:
        async with session.post(config.url, json=body, trace_request_ctx=_Stamps(record, t0)) as resp:
            record.headers_s = clock() - t0
            record.http_status = resp.status
            if resp.status != 200:
                record.error = _error_text(resp.status, await resp.text())
                return record
            if not config.stream:
                return _whole_response(record, await resp.json(), clock() - t0)
            async for raw in resp.content:
                now = clock() - t0
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if not isinstance(chunk, dict):
                    record.error = f"unexpected stream event: {payload[:100]!r}"
                    return record
                if "error" in chunk:
                    err = chunk["error"]
                    record.error = (
                        f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    )
                    return record
                text, finish = _chunk_text(chunk, config.is_chat)
                if text:
                    record.chunk_times_s.append(now)
                if finish:
                    record.finish_reason = finish
                usage = chunk.get("usage")
                if usage:
                    record.usage_reported = True
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.completion_tokens = usage.get("completion_tokens")
        if not done:
            record.error = "the stream ended without [DONE]"
            return record
        record.ok = True
    except asyncio.CancelledError:
        raise
    # ValueError: bad JSON, bad UTF-8, or a line longer than aiohttp's reader takes.
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        record.end_s = clock() - t0
    return record


async def run_load(requests: list[BenchRequest], config: LoadConfig) -> LoadRun:
    """Send `requests` on the configured schedule and return every request's record."""
    import aiohttp

    # Checked before anything is sent: a token-id prompt on the chat endpoint is a usage error.
    for req in requests[:1]:
        request_body(config, req)
    offsets = arrival_offsets(len(requests), config.request_rate, config.arrivals, random.Random(config.seed))
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # No pool limit of aiohttp's own: the cap above is the only one, so it is the one measured.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    started_unix = time.time()
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=timeout, trace_configs=[_trace_config()]
    ) as session:
        t0 = time.perf_counter()

        async def one(index: int, req: BenchRequest, at: float) -> RequestRecord:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(index, req.output_len, req.input_len, scheduled_s=time.perf_counter() - t0)
            if slots is None:
                await send_one(session, config, req, record, t0)
            else:
                async with slots:
                    await send_one(session, config, req, record, t0)
            return record

        records = await asyncio.gather(
            *(one(i, r, at) for i, (r, at) in enumerate(zip(requests, offsets, strict=True)))
        )
        duration = time.perf_counter() - t0
    return LoadRun(list(records), duration, started_unix)
