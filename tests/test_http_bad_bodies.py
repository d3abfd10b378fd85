"""Bodies that used to end in a 500 (issue 20's probe): JSON nested too deeply, and a lone UTF-16
surrogate in a string. Both are the client's mistake: a 400 with OpenAI's error body."""

from __future__ import annotations

import json

import pytest
from blink_appliance.frontend.app import create_app
from blink_appliance.frontend.model_router import ModelRouter

ROUTES = ["/v1/completions", "/v1/chat/completions"]


async def _post(aiohttp_client, route: str, data: bytes) -> tuple[int, dict]:
    # The body is refused before the service is asked: a router with no model stands in for the engines.
    client = await aiohttp_client(create_app(ModelRouter([]), api_keys=()))
    r = await client.post(route, data=data, headers={"Content-Type": "application/json"})
    return r.status, await r.json()


@pytest.mark.parametrize("route", ROUTES)
async def test_json_nested_too_deeply_is_a_400(aiohttp_client, route):
    status, body = await _post(aiohttp_client, route, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400, body
    assert body["error"]["message"] == "the request body is not valid JSON: nested too deeply"


@pytest.mark.parametrize(
    ("route", "data"),
    [
        ("/v1/completions", rb'{"model": "m", "prompt": "a\ud800b"}'),
        ("/v1/chat/completions", rb'{"model": "m", "messages": [{"role": "user", "content": "x\uDC00"}]}'),
    ],
)
async def test_a_lone_surrogate_is_a_400(aiohttp_client, route, data):
    status, body = await _post(aiohttp_client, route, data)
    assert status == 400, body
    assert "unpaired UTF-16 surrogate" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


async def test_a_surrogate_pair_is_a_character_and_passes_the_check(aiohttp_client):
    """An escaped pair (an emoji) is valid Unicode: the body goes on to the schema, which refuses
    the missing model field, not the text."""
    status, body = await _post(aiohttp_client, "/v1/completions", rb'{"prompt": "\ud83d\ude00"}')
    assert status == 400 and "surrogate" not in body["error"]["message"], body


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("max_tokens", 3.0), ("max_tokens", True), ("stream", "yes"), ("stream", 1),
     ("temperature", "0.5"), ("seed", "7"), ("ignore_eos", "true"), ("stop_token_ids", ["5"])],
)  # fmt: skip
async def test_values_of_the_wrong_json_type_are_a_400_not_coerced(aiohttp_client, field, value):
    """Issue 20 defect 11: "5", 3.0 or true for an integer, "yes" for a boolean were accepted."""
    data = json.dumps({"model": "m", "prompt": "hi", field: value}).encode()
    status, body = await _post(aiohttp_client, "/v1/completions", data)
    assert status == 400, body
    assert body["error"]["param"] == field and body["error"]["code"] == "invalid_value", body


def test_ints_are_still_accepted_where_a_float_is_asked():
    from blink_appliance.frontend.openai_schema import CompletionRequest, parse_request

    req = parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 1, "top_p": 1})
    assert req.temperature == 1.0 and req.top_p == 1.0
