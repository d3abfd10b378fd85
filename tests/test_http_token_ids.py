"""The front end serving a model without a tokenizer (`dummy:` presets): token-id prompts, ids as text.

The real aiohttp app and CompletionService over a scripted engine client that answers each
request with the next ids of its prompt (so what came out is checkable against what went in).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from blink_appliance.frontend.app import create_app
from blink_appliance.frontend.completion_service import CompletionService, ServiceLimits
from blink_appliance.frontend.metrics import ServingMetrics
from blink_appliance.frontend.token_id_vocabulary import (
    TokenIdVocabulary,
    token_id_vocabulary_for,
    token_ids_text,
)

from blink_appliance.model.detokenizer import IncrementalDetokenizer
from blink_appliance.wire.request import FinishReason, SamplingParams, TokenEvent

MODEL = "tiny"
VOCAB = 512


class CountingEngine:
    """Answers a prompt ending in id k with k+1, k+2, ... (max_tokens of them), then "length"."""

    engine_alive = True

    def __init__(self) -> None:
        self.submitted: list[tuple[list[int], SamplingParams]] = []

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        self.submitted.append((list(prompt_ids), params))
        return len(self.submitted) - 1

    async def stream_batches(self, request_id: int, whole: bool = False) -> AsyncIterator[list[TokenEvent]]:
        """The first token alone, the rest in one batch: as a loaded front end gets them."""
        ids, params = self.submitted[request_id]
        events = [
            TokenEvent(request_id, ids[-1] + n, FinishReason.LENGTH if n == params.max_tokens else None)
            for n in range(1, params.max_tokens + 1)
        ]
        for batch in (events[:1], events[1:]):
            if batch:
                yield batch

    def telemetry(self) -> dict:
        return {}


@pytest.fixture
async def served(aiohttp_client):
    engine = CountingEngine()
    vocab = token_id_vocabulary_for(f"dummy:{MODEL}")
    assert vocab is not None and vocab.vocab_size == VOCAB
    limits = ServiceLimits(
        model_name=MODEL, max_model_len=128, max_prompt_tokens=100, max_output_tokens=64, max_stop_ids=4
    )
    metrics = ServingMetrics(MODEL, engine_telemetry=dict, engine_alive=lambda: True)

    def detokenizer(tok: object, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=True)

    service = CompletionService(engine, vocab, detokenizer, limits, metrics)
    return await aiohttp_client(create_app(service)), engine


def test_stand_in_only_for_dummy_sources():
    assert token_id_vocabulary_for("dummy:llama-3.2-1b").vocab_size == 128256
    assert token_id_vocabulary_for("smollm2-135m-instruct") is None
    assert token_id_vocabulary_for("gguf:/x.gguf") is None
    with pytest.raises(ValueError, match="unknown dummy preset"):
        token_id_vocabulary_for("dummy:nope")
    assert token_ids_text([5, 0, 4096]) == " 5 0 4096"
    assert TokenIdVocabulary(8, "dummy:x").decode([1, 2]) == " 1 2"


async def test_token_id_prompt_streams_the_ids_each_batch_as_one_piece(served):
    client, engine = served
    body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200
    events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    # The first token alone, then the three that arrived together as one chunk (the engine's batches).
    assert texts == [" 10", " 11 12 13"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert engine.submitted[0][0] == [7, 8, 9]


async def test_non_streaming_and_one_element_batch_of_ids(served):
    client, engine = served
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[100]], "max_tokens": 3})
    assert r.status == 200
    body = await r.json()
    assert body["choices"][0]["text"] == " 101 102 103"
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hello"}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            "messages",
        ),
    ],
)
async def test_text_and_chat_are_refused_saying_to_send_ids(served, path, body, param):
    client, engine = served
    r = await client.post(path, json=body)
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == param and err["code"] == "tokenizer_unavailable"
    assert "token id" in err["message"].replace("-", " ")
    assert engine.submitted == []


async def test_ids_outside_the_preset_vocabulary_are_refused(served):
    client, engine = served
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, VOCAB], "max_tokens": 1})
    assert r.status == 400
    assert f"outside the vocabulary [0, {VOCAB})" in (await r.json())["error"]["message"]
    assert engine.submitted == []


async def test_tokenize_and_detokenize_without_a_tokenizer(served):
    """/tokenize of text needs a tokenizer (the same 400 as completions); /detokenize writes the ids;
    `model` may be left out when one model is served."""
    client, _ = served
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello"})
    assert r.status == 400 and (await r.json())["error"]["code"] == "tokenizer_unavailable"
    r = await client.post("/detokenize", json={"tokens": [1, 2, 511]})
    assert r.status == 200 and await r.json() == {"prompt": " 1 2 511"}
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, VOCAB]})
    err = (await r.json())["error"]
    assert (
        r.status == 400
        and err["param"] == "tokens"
        and f"outside the vocabulary [0, {VOCAB})" in err["message"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "colour": 1}, 400, "unknown parameter 'colour'"),
        ("/tokenize", {"model": MODEL}, 400, "missing required parameter 'prompt'"),
        ("/tokenize", [1, 2], 400, "must be a JSON object"),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "invalid 'messages'"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "invalid 'tokens'"),
        ("/detokenize", {"model": MODEL, "tokens": [True]}, 400, "invalid 'tokens.0'"),
    ],
)
async def test_tokenize_routes_refuse_bad_bodies(served, path, body, status, fragment):
    client, _ = served
    r = await client.post(path, json=body)
    assert r.status == status
    assert fragment in (await r.json())["error"]["message"]
