"""Bodies that used to end in a 500 (issue 20's probe): JSON nested too deeply, and a lone UTF-16
surrogate in a string. Both are the client's mistake: a 400 with OpenAI's error body."""

from __future__ import annotations

import pytest
from blink_appliance.frontend.app import create_app

ROUTES = ["/v1/completions", "/v1/chat/completions"]


async def _post(aiohttp_client, route: str, data: bytes) -> tuple[int, dict]:
    # The body is refused before the service is asked: a placeholder stands in for the engine's.
    client = await aiohttp_client(create_app(object(), api_keys=()))  # type: ignore[arg-type]
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
