"""n > 1 over HTTP, driven by the `openai` client against a live appliance: n choices of one
request, each its own seed stream (seed + i), streamed and whole, with their usage summed."""

from __future__ import annotations

import openai
import pytest

from tests.live_appliance import API_KEY, MODEL_NAME, completion_request, post_json


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_each_choice_is_the_request_with_seed_plus_its_index(live):
    client = _client(live)
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0)
    r = client.completions.create(n=3, seed=40, logprobs=1, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=40 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1  # the seed streams differ
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.prompt_tokens == client.completions.create(**{**kw, "max_tokens": 1}).usage.prompt_tokens


def test_streamed_choices_arrive_interleaved_and_end_once_each(live):
    client = _client(live)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, n=2,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text, finishes, roles, usage = {0: "", 1: ""}, {0: 0, 1: 0}, {0: 0, 1: 0}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            finishes[c.index] += c.finish_reason is not None
    assert finishes == {0: 1, 1: 1} and roles == {0: 1, 1: 1}
    assert text[0] == text[1] and text[0]  # greedy: the same answer twice
    assert usage.completion_tokens % 2 == 0 and usage.completion_tokens > 0


@pytest.mark.parametrize("n", [0, 129])
async def test_n_outside_1_to_128_is_a_400(live, n):
    status, body, _ = await post_json(live, "/v1/completions", completion_request("Hi", max_tokens=2, n=n))
    assert status == 400 and body["error"]["param"] == "n"
