"""The OpenAI-compatible API over real HTTP against a live `blink-appliance up` (real rings, real engine
process): endpoints, request parameters and error paths.

One appliance (SmolLM2-135M-Instruct, greedy unless a test says otherwise, small max_tokens; the
`live` fixture of tests/conftest.py) serves the whole module.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.live_appliance import (
    API_KEY,
    MODEL_NAME,
    LiveAppliance,
    chat_request,
    completion_request,
    post_json,
    stream_events,
)

# -- endpoints ----------------------------------------------------------------------------------


async def test_health_models_and_metrics(live):
    async with aiohttp.ClientSession() as s:
        async with s.get(live.url + "/health") as r:  # open without a key
            assert r.status == 200
            assert (await r.json())["status"] == "ok"
        async with s.get(live.url + "/v1/models", headers=live.headers) as r:
            body = await r.json()
            assert [m["id"] for m in body["data"]] == [MODEL_NAME]
        async with s.get(live.url + f"/v1/models/{MODEL_NAME}", headers=live.headers) as r:
            assert (await r.json())["id"] == MODEL_NAME
        async with s.get(live.url + "/v1/models/nope", headers=live.headers) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    await post_json(live, "/v1/completions", completion_request("Hello", max_tokens=3))
    async with aiohttp.ClientSession() as s:
        async with s.get(live.url + "/metrics") as r:
            text = await r.text()
    for series in (
        "blink_time_to_first_token_seconds_bucket",
        "blink_time_per_output_token_seconds_bucket",
        "blink_e2e_request_latency_seconds_count",
        "blink_prompt_tokens_total",
        "blink_generation_tokens_total",
        "blink_num_requests_running",
        "blink_num_requests_waiting",
        "blink_kv_cache_usage_ratio",
        'blink_engine_alive{model_name="smollm2-135m-instruct"} 1.0',
        'blink_engine_step_seconds_bucket{le="3.2e-05",model_name="smollm2-135m-instruct"}',
        'blink_ring_payload_waits_total{model_name="smollm2-135m-instruct"} 0.0',
    ):
        assert series in text, series
    # The engine's step-time histogram counts the steps of that completion (telemetry is periodic).
    steps = 0.0
    for _ in range(100):
        async with aiohttp.ClientSession() as s:
            async with s.get(live.url + "/metrics") as r:
                text = await r.text()
        inf = [ln for ln in text.splitlines() if ln.startswith('blink_engine_step_seconds_bucket{le="+Inf"')]
        steps = float(inf[0].rsplit(" ", 1)[1])
        if steps >= 3:
            break
        await asyncio.sleep(0.05)
    assert steps >= 3  # a prefill and two decodes at least


async def test_telemetry_route_is_served(live):
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/telemetry") as r:
            assert r.status == 200
            snap = await r.json()
    assert snap["models"][0]["name"] == MODEL_NAME


async def test_completion_greedy_usage_and_length(live):
    status, body, _ = await post_json(
        live, "/v1/completions", completion_request("The capital of France is", max_tokens=5, ignore_eos=True)
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    # greedy is deterministic
    _, again, _ = await post_json(
        live, "/v1/completions", completion_request("The capital of France is", max_tokens=5, ignore_eos=True)
    )
    assert again["choices"][0]["text"] == choice["text"]


async def test_prompt_as_token_ids_equals_text_prompt(live):
    from blink_appliance.model.sources import load_tokenizer

    tok = load_tokenizer(_source_of(live))
    ids = tok.encode("Once upon a time", add_special_tokens=True)
    _, by_text, _ = await post_json(
        live, "/v1/completions", completion_request("Once upon a time", max_tokens=4, ignore_eos=True)
    )
    _, by_ids, _ = await post_json(
        live, "/v1/completions", completion_request(ids, max_tokens=4, ignore_eos=True)
    )
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_tokenize_gives_the_ids_completions_use_and_detokenize_inverts_it(live):
    """vLLM's /tokenize: the ids are the ones a completion's and a chat's prompt_tokens count; HF
    transformers' tokenizer (loaded from the same GGUF) gives the same ids; /detokenize returns the text."""
    text = "Once upon a time, in a land far away"
    status, tok, _ = await post_json(live, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    assert tok["token_strs"] is None
    _, whole, _ = await post_json(live, "/v1/completions", completion_request(text, max_tokens=1))
    assert whole["usage"]["prompt_tokens"] == tok["count"]
    source = _source_of(live)
    if source.startswith("gguf:"):
        from transformers import AutoTokenizer

        path = Path(source.removeprefix("gguf:"))
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        assert tok["tokens"] == hf(text)["input_ids"]
    status, back, _ = await post_json(live, "/detokenize", {"model": MODEL_NAME, "tokens": tok["tokens"]})
    assert status == 200 and back["prompt"] == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    status, chat_tok, _ = await post_json(
        live, "/tokenize", {"model": MODEL_NAME, "messages": messages, "return_token_strs": True}
    )
    _, chat, _ = await post_json(live, "/v1/chat/completions", chat_request("What is 2+2?", max_tokens=1))
    assert status == 200 and chat["usage"]["prompt_tokens"] == chat_tok["count"]
    assert len(chat_tok["token_strs"]) == chat_tok["count"] and all(
        isinstance(t, str) for t in chat_tok["token_strs"]
    )
    status, no_prompt, _ = await post_json(
        live, "/tokenize", {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": False}
    )
    assert status == 200 and no_prompt["count"] < chat_tok["count"]
    status, err, _ = await post_json(live, "/tokenize", {"prompt": text}, headers={})
    assert status == 401, err


def _source_of(live: LiveAppliance) -> str:
    for line in (Path(live.log_path).parent / "profile.toml").read_text().splitlines():
        if line.startswith("source = "):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError("no source in profile")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streaming_equals_non_streaming_greedy(live, path):
    body = (
        chat_request("Name three colors.", max_tokens=12)
        if "chat" in path
        else completion_request("1, 2, 3,", max_tokens=12)
    )
    status, whole, _ = await post_json(live, path, body)
    assert status == 200, whole
    events = await stream_events(live, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    if "chat" in path:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text == whole["choices"][0]["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]


async def test_stream_without_include_usage_has_no_usage_chunk(live):
    events = await stream_events(live, "/v1/completions", completion_request("Hi", max_tokens=3))
    assert all("usage" not in e for e in events if isinstance(e, dict))


def test_official_openai_client(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=10)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, temperature=0, max_tokens=10, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    comp = client.completions.create(
        model=MODEL_NAME, prompt="Hello, my name is", temperature=0, max_tokens=4
    )
    assert comp.choices[0].text and comp.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, n=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- parameters ---------------------------------------------------------------------------------


async def test_sampling_parameters_seeded_reproducible(live):
    body = completion_request(
        "The weather today",
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        ignore_eos=True,
    )
    outs = []
    for _ in range(2):
        status, r, _ = await post_json(live, "/v1/completions", body)
        assert status == 200, r
        outs.append(r["choices"][0]["text"])
    assert outs[0] == outs[1]
    assert r["usage"]["completion_tokens"] == 8


async def test_max_tokens_and_max_completion_tokens(live):
    _, r, _ = await post_json(
        live,
        "/v1/chat/completions",
        chat_request("Count to twenty.", max_completion_tokens=3, ignore_eos=True),
    )
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    _, r, _ = await post_json(
        live, "/v1/chat/completions", chat_request("Count to twenty.", max_tokens=2, ignore_eos=True)
    )
    assert r["usage"]["completion_tokens"] == 2


async def test_stop_strings_cut_the_text(live):
    base = completion_request("1, 2, 3, 4, 5,", max_tokens=16, ignore_eos=True)
    _, free, _ = await post_json(live, "/v1/completions", base)
    text = free["choices"][0]["text"]
    assert len(text) > 3
    stop = text[2:4]  # something greedy decoding is known to produce
    _, cut, _ = await post_json(live, "/v1/completions", {**base, "stop": [stop, "never-appears"]})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    events = await stream_events(live, "/v1/completions", {**base, "stop": stop})
    streamed = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
    assert streamed == cut["choices"][0]["text"]


async def test_stop_token_ids_end_with_stop(live):
    from blink_appliance.model.sources import load_tokenizer

    base = completion_request("1, 2, 3, 4, 5,", max_tokens=16, ignore_eos=True)
    _, free, _ = await post_json(live, "/v1/completions", {**base, "max_tokens": 3})
    tok = load_tokenizer(_source_of(live))
    prompt_ids = tok.encode("1, 2, 3, 4, 5,", add_special_tokens=True)
    full_ids = tok.encode("1, 2, 3, 4, 5," + free["choices"][0]["text"], add_special_tokens=True)
    second = full_ids[len(prompt_ids) + 1] if len(full_ids) > len(prompt_ids) + 1 else full_ids[-1]
    _, r, _ = await post_json(live, "/v1/completions", {**base, "stop_token_ids": [second]})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] <= 3


async def test_chat_without_max_tokens_ends_on_eos_or_length(live):
    status, r, _ = await post_json(live, "/v1/chat/completions", chat_request("Say hi.", max_tokens=40))
    assert status == 200
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


# -- error paths --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"n": 0}, "n", "invalid 'n'"),
        ({"logprobs": 21}, "logprobs", "invalid 'logprobs'"),
        ({"logprobs": True}, "logprobs", "invalid 'logprobs'"),
        ({"top_logprobs": 2}, "top_logprobs", "chat completions parameter"),
        ({"max_tokens": 0, "echo": False}, "max_tokens", "needs echo=true"),
        ({"best_of": 3}, "best_of", "not supported yet"),
        ({"logit_bias": {"one": 5}}, "logit_bias", "keys are token ids"),
        ({"logit_bias": {"1": 101}}, "logit_bias", "must be in [-100, 100]"),
        ({"logit_bias": {"1": 1, "01": 2}}, "logit_bias", "more than once"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", "invalid 'presence_penalty'"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid 'repetition_penalty'"),
        ({"temperature": -1}, "temperature", "invalid 'temperature'"),
        ({"top_p": 0}, "top_p", "invalid 'top_p'"),
        ({"max_tokens": -1}, "max_tokens", "invalid 'max_tokens'"),
        ({"max_tokens": 100000}, "max_tokens", "too large"),
        ({"frobnicate": 1}, "frobnicate", "unknown parameter"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids", "outside the vocabulary"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"prompt": "word " * 600}, "prompt", "at most"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ],
)
async def test_completion_400s(live, body, param, fragment):
    status, r, _ = await post_json(
        live, "/v1/completions", {**completion_request("Hi", max_tokens=2), **body}
    )
    assert status == 400, r
    err = r["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto"
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ({"model": None}, "model"),
    ],
)
async def test_chat_400s(live, body, param):
    status, r, _ = await post_json(live, "/v1/chat/completions", {**chat_request("Hi", max_tokens=2), **body})
    assert status == 400, r
    assert r["error"]["param"] == param


async def test_other_error_statuses(live):
    status, r, _ = await post_json(live, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in r["error"]["message"]
    status, r, _ = await post_json(live, "/v1/completions", "[1, 2]")
    assert status == 400
    status, r, _ = await post_json(live, "/v1/completions", {**completion_request("x" * 70000)})
    assert status == 413 and r["error"]["code"] == "request_too_large"
    status, r, _ = await post_json(live, "/v1/completions", completion_request("Hi"), headers={})
    assert status == 401 and r["error"]["code"] == "invalid_api_key"
    status, r, _ = await post_json(
        live, "/v1/completions", completion_request("Hi"), headers={"Authorization": "Bearer nope-nope-nope"}
    )
    assert status == 401
    status, r, _ = await post_json(live, "/v1/completions", {**completion_request("Hi"), "model": "other"})
    assert status == 404 and r["error"]["param"] == "model"
    status, r, _ = await post_json(live, "/v1/nothing-here", {})
    assert status == 404 and "error" in r
    async with aiohttp.ClientSession(headers=live.headers) as s:
        async with s.get(live.url + "/v1/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()


async def _prefix_counters(live: LiveAppliance) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(live.url + "/metrics") as r:
            text = await r.text()
    values = {}
    for name in ("blink_prefix_cache_queries_total", "blink_prefix_cache_hits_total"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        values[name] = float(line.rsplit(" ", 1)[1])
    return values["blink_prefix_cache_queries_total"], values["blink_prefix_cache_hits_total"]


async def test_prefix_cache_reuses_a_repeated_prefix_and_keeps_the_output(live):
    """The reference profile caches prefixes by default: a second request with the same long prefix
    finds its blocks cached (/metrics, tokens) and answers what the first answered."""
    system = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    req = completion_request(system + "What is the capital of Italy?", max_tokens=6, ignore_eos=True)

    async def counted_after(before: float) -> tuple[float, float]:
        for _ in range(500):  # the engine writes its telemetry words every 10 ms
            queries, hits = await _prefix_counters(live)
            if queries > before:
                return queries, hits
            await asyncio.sleep(0.02)
        raise AssertionError("the prefix cache's counters did not move")

    queries_before, _ = await _prefix_counters(live)
    status, first, _ = await post_json(live, "/v1/completions", req)
    assert status == 200, first
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens >= 48
    queries0, hits0 = await counted_after(queries_before)
    _, again, _ = await post_json(live, "/v1/completions", req)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    queries, hits = await counted_after(queries0)
    assert queries - queries0 == prompt_tokens
    assert hits - hits0 == (prompt_tokens - 1) // 16 * 16  # every full block but a last one that ends it


async def test_n_choices_share_the_prompt_blocks_of_the_first(live):
    """n > 1 with the prefix cache: the first choice goes in alone, the others once its prompt is
    computed, so each of them finds its full blocks cached."""
    prompt = "Write one sentence about the sea, the wind and a small boat leaving the harbour. " * 3
    queries0, hits0 = await _prefix_counters(live)
    status, body, _ = await post_json(
        live, "/v1/completions", completion_request(prompt, max_tokens=4, ignore_eos=True, n=3)
    )
    assert status == 200, body
    assert len({c["text"] for c in body["choices"]}) == 1  # greedy: the same text three times
    n_prompt = body["usage"]["prompt_tokens"]
    for _ in range(500):  # the engine writes its telemetry words every 10 ms
        queries, hits = await _prefix_counters(live)
        if queries - queries0 >= 3 * n_prompt:
            break
        await asyncio.sleep(0.02)
    assert queries - queries0 == 3 * n_prompt
    assert hits - hits0 == 2 * ((n_prompt - 1) // 16 * 16)  # the second and third choices
