"""Priority classes through HTTP (issue 22): the `priority` request field, per-key classes, the
model's default, and the effective priority the engine receives in the ring record.

The real aiohttp app, auth middleware and CompletionService, over a real EngineClient on a shared-
memory region served by the reference ring server with a CounterEngine (tests/ring_support.py): the
priority asserted is the one the engine side decoded from the request record.

Effective priority: base = the class of the request's API key if it has one, else the model's
`priority`; a request's own `priority` can only lower it (a larger number): max(base, requested).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from blink_appliance.frontend.app import create_app
from blink_appliance.frontend.auth import BearerKey, configured_keys
from blink_appliance.frontend.completion_service import CompletionService, ServiceLimits
from blink_appliance.frontend.metrics import MetricsRegistry, ServingMetrics

from blink_appliance.profile import ApiKey
from blink_appliance.telemetry import TelemetrySource
from blink_appliance.wire.request import Request
from tests.ring_support import SMALL, VOCAB, CounterEngine, client_for, server_thread, shm_region

MODEL = "tiny"
PLAIN, BATCH, LIVE, ENV = "plain-key-123", "batch-key-123", "live-key-1234", "env-key-12345"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class CharTokenizer:
    """One id per character (offset past the special ids), a chat template that joins the turns."""

    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % (VOCAB - 4) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class IdText:
    """Each token's text is its id (" 17"): enough for these tests, which read the ring, not text."""

    def __init__(self, tokenizer: object, prompt_ids: list[int]) -> None:
        self._held: list[str] = []

    def feed(self, token_id: int) -> str:
        return self.flush() + f" {token_id}"

    def hold(self, token_id: int) -> str:
        self._held.append(f" {token_id}")
        return ""

    def flush(self) -> str:
        text, self._held = "".join(self._held), []
        return text


class Served:
    def __init__(self, client: Any, engine: CounterEngine, seen: list[Request], registry: MetricsRegistry):
        self.client, self.engine, self.seen, self.registry = client, engine, seen, registry
        self.telemetry: TelemetrySource | None = None
        self.service: CompletionService | None = None

    async def complete(self, key: str | None = None, chat: bool = False, **fields: Any) -> Any:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = [5, 6, 7]
        body.update(fields)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return await self.client.post(
            "/v1/chat/completions" if chat else "/v1/completions", json=body, headers=headers
        )

    async def priority_of(self, key: str | None = None, chat: bool = False, **fields: Any) -> int:
        """The priority the engine received for one request (which must succeed)."""
        before = len(self.seen)
        r = await self.complete(key, chat, **fields)
        assert r.status == 200, await r.text()
        assert len(self.seen) == before + 1
        return self.seen[-1].priority


@contextlib.asynccontextmanager
async def serving(
    aiohttp_client: Any, *, keys: tuple[BearerKey, ...] = (), default_priority: int = 0
) -> AsyncIterator[Served]:
    engine = CounterEngine()
    seen: list[Request] = []
    original = engine.add_request
    engine.add_request = lambda req: (seen.append(req), original(req))[1]  # type: ignore[method-assign]
    registry = MetricsRegistry()
    telemetry = TelemetrySource(None, models=[MODEL])
    with shm_region() as transport, server_thread(engine, transport):
        async with client_for(transport) as ring:
            metrics = ServingMetrics(
                MODEL,
                engine_telemetry=ring.telemetry,
                engine_alive=lambda: ring.engine_alive,
                tracker=telemetry.latency(MODEL),
                class_tracker=lambda priority: telemetry.class_latency(MODEL, priority),
                registry=registry,
            )
            limits = ServiceLimits(
                model_name=MODEL,
                max_model_len=SMALL.max_prompt_tokens + SMALL.max_output_tokens,
                max_prompt_tokens=SMALL.max_prompt_tokens,
                max_output_tokens=SMALL.max_output_tokens,
                max_stop_ids=SMALL.max_stop_ids,
                default_priority=default_priority,
            )
            service = CompletionService(ring, CharTokenizer(), IdText, limits, metrics)
            served = Served(await aiohttp_client(create_app(service, api_keys=keys)), engine, seen, registry)
            served.telemetry, served.service = telemetry, service
            yield served


async def test_priority_is_accepted_on_both_endpoints_and_reaches_the_engine(aiohttp_client):
    async with serving(aiohttp_client) as s:
        for chat in (False, True):
            assert await s.priority_of(chat=chat) == 0  # nothing sent: the model's default
            assert await s.priority_of(chat=chat, priority=7) == 7  # lowered: taken as is
            assert await s.priority_of(chat=chat, priority=0) == 0
            assert await s.priority_of(chat=chat, priority=INT32_MAX) == INT32_MAX
            # A request cannot raise itself above its base (the model's default here).
            assert await s.priority_of(chat=chat, priority=-5) == 0
            assert await s.priority_of(chat=chat, priority=INT32_MIN) == 0
            assert await s.priority_of(chat=chat, priority=None) == 0  # null: not sent
        # A streamed request carries it too.
        r = await s.complete(priority=9, stream=True)
        assert r.status == 200 and (await r.text()).rstrip().endswith("data: [DONE]")
        assert s.seen[-1].priority == 9


async def test_the_models_default_is_the_base(aiohttp_client):
    async with serving(aiohttp_client, default_priority=3) as s:
        assert await s.priority_of() == 3
        assert await s.priority_of(priority=10) == 10
        assert await s.priority_of(priority=1) == 3  # cannot run before the model's class
        assert await s.priority_of(chat=True, priority=-100) == 3


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (True, "Input should be a valid integer"),
        (False, "Input should be a valid integer"),
        (1.5, "Input should be a valid integer"),
        (2.0, "Input should be a valid integer"),
        ("5", "Input should be a valid integer"),
        ([1], "Input should be a valid integer"),
        (INT32_MAX + 1, "Input should be less than or equal to 2147483647"),
        (INT32_MIN - 1, "Input should be greater than or equal to -2147483648"),
    ],
)
async def test_a_bad_priority_is_a_400_naming_it(aiohttp_client, value, why):
    async with serving(aiohttp_client) as s:
        for chat in (False, True):
            r = await s.complete(chat=chat, priority=value)
            assert r.status == 400
            assert await r.json() == {
                "error": {
                    "message": f"invalid 'priority': {why}",
                    "type": "invalid_request_error",
                    "param": "priority",
                    "code": "invalid_value",
                }
            }
        assert not s.seen  # nothing reached the engine


def profile_keys(environ: dict[str, str]) -> tuple[BearerKey, ...]:
    """The keys as the front end's process builds them from the profile's entries and the env."""
    entries = [ApiKey(key=PLAIN), ApiKey(key=BATCH, priority=20), ApiKey(key=LIVE, priority=-10)]
    return configured_keys(entries, environ)


async def test_a_keys_class_is_its_requests_base_and_they_cannot_rise_above_it(aiohttp_client):
    keys = profile_keys({"BLINK_API_KEY": ENV})
    assert keys[-1] == BearerKey(ENV)  # BLINK_API_KEY: a key without a class
    async with serving(aiohttp_client, keys=keys, default_priority=3) as s:
        for chat in (False, True):
            assert await s.priority_of(BATCH, chat) == 20
            assert await s.priority_of(BATCH, chat, priority=0) == 20  # no raising above the class
            assert await s.priority_of(BATCH, chat, priority=-10) == 20
            assert await s.priority_of(BATCH, chat, priority=25) == 25  # lowering is fine
            assert await s.priority_of(LIVE, chat) == -10  # a class above the model's default
            assert await s.priority_of(LIVE, chat, priority=-20) == -10
            assert await s.priority_of(LIVE, chat, priority=5) == 5
            # Keys without a class: the model's default.
            assert await s.priority_of(PLAIN, chat) == 3
            assert await s.priority_of(PLAIN, chat, priority=1) == 3
            assert await s.priority_of(ENV, chat) == 3
            assert await s.priority_of(ENV, chat, priority=8) == 8
        r = await s.complete(None, priority=0)
        assert r.status == 401
        r = await s.complete("not-a-key-at-all", priority=100)
        assert r.status == 401


async def test_a_profile_key_equal_to_blink_api_key_keeps_its_class(aiohttp_client):
    async with serving(aiohttp_client, keys=profile_keys({"BLINK_API_KEY": BATCH})) as s:
        assert await s.priority_of(BATCH) == 20


def sample_value(text: str, sample: str) -> float:
    line = next((line for line in text.splitlines() if line.startswith(sample + " ")), None)
    assert line is not None, f"{sample} not in:\n{text}"
    return float(line.rsplit(" ", 1)[1])


async def test_metrics_and_telemetry_are_per_class(aiohttp_client):
    async with serving(aiohttp_client, keys=profile_keys({}), default_priority=3) as s:
        for key, n in ((BATCH, 4), (BATCH, 2), (PLAIN, 3), (LIVE, 5)):
            assert (await s.complete(key, max_tokens=n)).status == 200
        r = await s.complete(BATCH, priority=30, stream=True, max_tokens=2)
        assert r.status == 200
        await r.text()
        text = await (await s.client.get("/metrics")).text()
        assert s.telemetry is not None
        snapshot = await s.telemetry.sample()

    counts = {"-10": 1, "3": 1, "20": 2, "30": 1}
    for prio, n in counts.items():
        labels = f'model_name="{MODEL}",priority="{prio}"'
        assert sample_value(text, f"blink_time_to_first_token_seconds_count{{{labels}}}") == n
        # Its first tokens' parts, each once per request, on one clock (the engine's stamps are
        # the host's monotonic ns): a stamp on another clock would make a part of hours or 0.
        for part in ("frontend", "engine", "delivery"):
            part_labels = f'model_name="{MODEL}",part="{part}",priority="{prio}"'
            assert sample_value(text, f"blink_first_token_part_seconds_count{{{part_labels}}}") == n
            assert 0 < sample_value(text, f"blink_first_token_part_seconds_sum{{{part_labels}}}") < 5 * n
        assert sample_value(text, f"blink_time_per_output_token_seconds_count{{{labels}}}") == n
        assert sample_value(text, f"blink_e2e_request_latency_seconds_count{{{labels}}}") == n
        success = f'blink_request_success_total{{finished_reason="length",{labels}}}'
        assert sample_value(text, success) == n
    # Token counters stay per model: 4 + 2 + 3 + 5 + 2 tokens.
    assert sample_value(text, f'blink_generation_tokens_total{{model_name="{MODEL}"}}') == 16
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))

    (model,) = snapshot.models
    assert [c.priority for c in model.classes] == [-10, 3, 20, 30]  # first to run first
    tokens = {c.priority: c.total_tokens for c in model.classes}
    assert tokens == {-10: 5, 3: 3, 20: 6, 30: 2}
    assert model.latency.total_tokens == 16
    for c in model.classes:
        assert c.ttft_p50_ms is not None and c.ttft_p99_ms is not None
        assert c.tpot_p50_ms is not None and c.tpot_p99_ms is not None
        assert c.tokens_per_s > 0
    # The wire format carries them.
    again = json.loads(snapshot.to_json())["models"][0]["classes"]
    assert [c["priority"] for c in again] == [-10, 3, 20, 30]


async def test_classes_past_the_cap_share_one_series_and_one_tracker():
    """A client picks any int32: past MAX_PRIORITY_CLASSES per model, classes are counted together
    (priority="other" in /metrics, priority null in the snapshot), so series stay bounded."""
    from blink_appliance.telemetry.latency import MAX_PRIORITY_CLASSES

    telemetry = TelemetrySource(None, models=[MODEL])
    metrics = ServingMetrics(
        MODEL,
        engine_telemetry=dict,
        engine_alive=lambda: True,
        class_tracker=lambda priority: telemetry.class_latency(MODEL, priority),
    )
    for priority in range(MAX_PRIORITY_CLASSES + 5):
        timer = metrics.request_timer(1, priority)
        timer.token()
        timer.token()
        timer.finish("length")
    metrics.error("busy", 10_000)
    text = metrics.render().decode()
    ttft = [line for line in text.splitlines() if line.startswith("blink_time_to_first_token_seconds_count")]
    assert len(ttft) == MAX_PRIORITY_CLASSES + 1
    other = f'model_name="{MODEL}",priority="other"'
    assert sample_value(text, f"blink_time_to_first_token_seconds_count{{{other}}}") == 5
    assert sample_value(text, f'blink_request_errors_total{{cause="busy",{other}}}') == 1
    classes = (await telemetry.sample()).models[0].classes
    assert [c.priority for c in classes] == [*range(MAX_PRIORITY_CLASSES), None]
    assert classes[-1].label == "other" and classes[-1].total_tokens == 10


async def test_a_burst_of_requests_is_prepared_in_turns_more_urgent_classes_first(aiohttp_client):
    """Ten best-effort requests and then one latency-sensitive one, all arriving in one event-loop
    iteration: the first goes at once (nobody waited), the urgent one next, then the others one per
    iteration."""
    from blink_appliance.frontend.openai_schema import CompletionRequest

    async with serving(aiohttp_client) as s:
        done: list[int] = []

        async def prepare(i: int, priority: int) -> None:
            req = CompletionRequest.model_validate({"model": MODEL, "prompt": [5, 6], "priority": priority})
            await s.service.prepare_completion(req)
            done.append(i)

        tasks = [asyncio.create_task(prepare(i, 5)) for i in range(10)]
        tasks.append(asyncio.create_task(prepare(99, 0)))
        await asyncio.gather(*tasks)
    assert done == [0, 99, *range(1, 10)]
