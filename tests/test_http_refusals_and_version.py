"""Issue 19's front-end pieces: /version (vLLM's shape, open without a key like /health), and 400s
that say image parts and legacy function messages are "not supported yet" instead of raw
validation text; tool conversations are templated."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from blink_appliance.frontend.app import create_app
from blink_appliance.frontend.errors import APIError
from blink_appliance.frontend.model_router import ModelRouter
from blink_appliance.frontend.openai_schema import ChatCompletionRequest, parse_request


def _refusal(messages: list[dict]) -> dict:
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": messages})
    assert info.value.status == 400
    return info.value.body()["error"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_a_media_content_part_is_not_supported_yet(part):
    err = _refusal([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
    assert err["param"] == "messages" and err["code"] == "unsupported_parameter"
    assert err["message"] == (
        f"messages[0].content[1]: '{part['type']}' content parts are not supported yet (only text parts)"
    )


def test_a_legacy_function_message_is_not_supported_yet():
    err = _refusal(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "function", "name": "f", "content": "18C"},
        ]
    )
    assert err["param"] == "messages" and err["code"] == "unsupported_parameter"
    assert (
        err["message"] == "messages[1]: 'function' messages are not supported yet (legacy function calling)"
    )


def test_a_tool_conversation_is_templated_with_the_calls_as_json():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    req = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            ],
        },
    )
    assert req.template_messages()[1:] == [
        {"role": "assistant", "content": '[{"name": "f", "arguments": "{\\"x\\": 1}"}]'},
        {"role": "tool", "content": "18C"},
    ]
    err = _refusal([{"role": "user", "content": "x", "tool_calls": [call]}])
    assert err["message"] == "messages[0]: only assistant messages carry tool_calls"


def test_text_parts_still_serve():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    req = parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": parts}]}
    )
    assert req.template_messages() == [{"role": "user", "content": "Hello, world"}]


async def test_version_route_needs_no_key(aiohttp_client):
    # /version touches no service: a router with no model stands in for the engines.
    client = await aiohttp_client(create_app(ModelRouter([]), api_keys=("secret-key-123",)))
    r = await client.get("/version")
    assert r.status == 200
    assert await r.json() == {"version": version("blink-appliance")}
    r = await client.get("/v1/models")
    assert r.status == 401  # the keys are on: only open routes answer without one
