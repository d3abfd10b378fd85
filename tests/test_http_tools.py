"""Tool calling over HTTP with the `openai` client against a live appliance (CPU reference engine,
SmolLM2): a named function and "required" constrain the reply to a call, read back as OpenAI's
tool_calls (whole and streamed); a round trip sends the call and its result back for an answer;
what cannot be served is a 400 naming the parameter."""

from __future__ import annotations

import json

import openai
import pytest

from tests.live_appliance import API_KEY, MODEL_NAME

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_named_function_call_round_trip(live):
    client = _client(live)
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=_named("get_weather"),
        temperature=0, max_tokens=40,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The call and its result go back; the model answers in text.
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_required_picks_one_of_the_tools_and_streams_as_openai_does(live):
    client = _client(live)
    for seed in (1, 2):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=60,
        )  # fmt: skip
        (call,) = out.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice=_named("get_weather"), temperature=0,
        max_tokens=40, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    # As OpenAI streams a call: the first delta opens it (id, name), the rest add to its arguments.
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and len(calls) > 2
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_what_tool_calling_cannot_serve_is_a_400(live):
    client = _client(live)
    for kw, param in (
        ({"tools": [WEATHER]}, "tool_choice"),  # the default, "auto"
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": _named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, **kw)
        assert info.value.body["param"] == param, (kw, info.value.body)
