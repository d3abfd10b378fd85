"""A streamed request ends in exactly one terminal event whatever fails after its 200 (issue 20,
defects 5 and 13): the real aiohttp app and CompletionService over scripted engine clients."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from blink_appliance.frontend.app import create_app
from blink_appliance.frontend.completion_service import CompletionService, ServiceLimits
from blink_appliance.frontend.metrics import ServingMetrics
from blink_appliance.frontend.openai_schema import CompletionRequest
from blink_appliance.frontend.token_id_vocabulary import token_id_vocabulary_for

from blink_appliance.model.detokenizer import IncrementalDetokenizer
from blink_appliance.wire.request import FinishReason, SamplingParams, TokenEvent

MODEL = "tiny"


class ScriptedEngine:
    """Streams ids 1, 2, ... and raises `fail_with` after `fail_after` of them."""

    engine_alive = True

    def __init__(self, fail_after: int = 2, fail_with: Exception | None = None) -> None:
        self.fail_after, self.fail_with = fail_after, fail_with
        self.submitted: list[SamplingParams] = []
        self.abandoned: list[int] = []

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        self.submitted.append(params)
        return len(self.submitted) - 1

    async def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[TokenEvent]]:
        yield [TokenEvent(request_id, n, None) for n in range(1, self.fail_after + 1)]
        raise self.fail_with or RuntimeError("scripted failure")

    def abandon(self, request_id: int) -> None:
        self.abandoned.append(request_id)

    def telemetry(self) -> dict:
        return {}


def service_for(engine: ScriptedEngine) -> CompletionService:
    vocab = token_id_vocabulary_for(f"dummy:{MODEL}")
    limits = ServiceLimits(
        model_name=MODEL, max_model_len=128, max_prompt_tokens=100, max_output_tokens=64, max_stop_ids=4
    )
    metrics = ServingMetrics(MODEL, engine_telemetry=dict, engine_alive=lambda: True)

    def detokenizer(tok: object, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=True)

    return CompletionService(engine, vocab, detokenizer, limits, metrics)


async def test_an_unexpected_error_mid_stream_still_ends_the_stream_with_an_error_and_done(aiohttp_client):
    client = await aiohttp_client(create_app(service_for(ScriptedEngine(fail_after=2))))
    body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 8, "stream": True}
    async with client.post("/v1/completions", json=body) as r:
        assert r.status == 200
        lines = [line.decode().strip() async for line in r.content if line.startswith(b"data: ")]
    payloads = [line[len("data: ") :] for line in lines]
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and "failed while streaming" in error["message"]
    assert sum(1 for p in payloads if p == "[DONE]") == 1


async def test_a_request_closed_before_its_stream_opens_is_cancelled_in_the_engine():
    """The client left while the 200's headers were being sent: the admitted request is abandoned
    (cancelled, forgotten), not left generating for nobody."""
    engine = ScriptedEngine()
    service = service_for(engine)
    prep = await service.prepare_completion(
        CompletionRequest.model_validate({"model": MODEL, "prompt": [7, 8], "max_tokens": 4, "stream": True})
    )
    pieces = service.generate(prep)
    await anext(pieces)  # admitted
    await pieces.aclose()
    assert engine.abandoned == [0]
    assert service.inflight == 0


class FailingInBatch(ScriptedEngine):
    """Two tokens and the engine's failure event, all in one batch (as a loaded front end gets them)."""

    async def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[TokenEvent]]:
        failure = TokenEvent(request_id, None, FinishReason.ERROR, "engine_failure: scripted")
        yield [TokenEvent(request_id, 1, None), TokenEvent(request_id, 2, None), failure]


async def test_text_that_arrived_with_a_failure_reaches_the_client_before_its_error(aiohttp_client):
    client = await aiohttp_client(create_app(service_for(FailingInBatch())))
    body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 8, "stream": True}
    async with client.post("/v1/completions", json=body) as r:
        assert r.status == 200
        payloads = [line.decode().strip()[6:] async for line in r.content if line.startswith(b"data: ")]
    assert payloads[-1] == "[DONE]" and "engine_failure" in json.loads(payloads[-2])["error"]["message"]
    texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-2]]
    assert "".join(texts) == " 1 2"
