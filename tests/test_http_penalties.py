"""Penalties and logit_bias over HTTP, driven by the `openai` client against a live appliance (CPU
reference engine, SmolLM2 in fp32): each reaches the engine and changes what it generates as the
engine's own penalties do (tests/test_penalties.py checks those against transformers)."""

from __future__ import annotations

import openai

from tests.live_appliance import API_KEY, MODEL_NAME

PROMPT = "Write the word 'apple' ten times:"


def _complete(live, **kw) -> openai.types.Completion:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    return client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=1, **kw
    )


def test_logit_bias_forces_and_bans_tokens(live):
    plain = _complete(live)
    first = plain.choices[0].logprobs.tokens[0]
    forced = _complete(live, logit_bias={str(_token_id(live, " banana")): 100})  # beats every other token
    assert set(forced.choices[0].logprobs.tokens) == {" banana"}
    banned = _complete(live, logit_bias={str(_token_id(live, first)): -100})
    assert first not in banned.choices[0].logprobs.tokens
    assert banned.choices[0].logprobs.tokens[1:] != plain.choices[0].logprobs.tokens[1:]


def _token_id(live, text: str) -> int:
    import json
    import urllib.request  # noqa: E401

    req = urllib.request.Request(
        live.url + "/tokenize", data=json.dumps({"model": MODEL_NAME, "prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        (token,) = json.loads(r.read())["tokens"]
    return token


def test_penalties_change_a_repetitive_completion(live):
    plain = _complete(live).choices[0]
    for kw in (
        dict(frequency_penalty=2.0),
        dict(presence_penalty=2.0),
        dict(extra_body={"repetition_penalty": 2.0}),  # vLLM's extension, as its clients send it
    ):
        penalized = _complete(live, **kw).choices[0]
        assert penalized.text != plain.text, kw
        assert len(set(penalized.logprobs.tokens)) >= len(set(plain.logprobs.tokens)), kw
