"""Structured output over HTTP, driven by the `openai` client against a live appliance (CPU reference
engine, SmolLM2): `beta.chat.completions.parse` with a pydantic model, vLLM's guided_choice and
guided_regex, a streamed json_schema; and which engines refuse constraints, and why."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest
from blink_appliance.frontend.__main__ import constraint_refusal

from tests.live_appliance import API_KEY, MODEL_NAME

jsonschema = pytest.importorskip("jsonschema")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_the_openai_client_parses_a_pydantic_model(live):
    completion = _client(live).beta.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Paris"}],  # longer prompts make greedy SmolLM2 count forever
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


def test_guided_choice_and_guided_regex_constrain_completions(live):
    client = _client(live)
    for seed in (1, 2, 3):
        out = client.completions.create(
            model=MODEL_NAME, prompt="Is water wet? Answer:", max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"guided_choice": ["yes", "no"]},
        )  # fmt: skip
        assert out.choices[0].text in {"yes", "no"} and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=MODEL_NAME, prompt="A date:", max_tokens=16, temperature=0,
        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )  # fmt: skip
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.choices[0].text)


def test_a_streamed_json_schema_reply_validates(live):
    schema = {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}
        },
        "required": ["colors"],
    }
    stream = _client(live).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name two colors as JSON."}], stream=True,
        max_tokens=60, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": schema, "strict": True}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_bad_constraints_are_400s(live):
    client = _client(live)
    for extra, param in (
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "[0-9]+", "ignore_eos": True}, None),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
        assert info.value.body["param"] == param, (extra, info.value.body)


def test_an_appliance_that_cannot_follow_a_constraint_says_why():
    class Tok:
        eos_token_ids = (2,)

    assert constraint_refusal(1 << 22, Tok(), "m") is None
    assert "constraint_words = 0" in constraint_refusal(0, Tok(), "m")
    assert "no tokenizer" in constraint_refusal(1 << 22, object(), "m")
