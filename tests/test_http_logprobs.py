"""Logprobs over HTTP, driven by the `openai` client against a live appliance (CPU reference engine,
SmolLM2 in fp32), checked against HF transformers on the same weights; and their refusals."""

from __future__ import annotations

import openai
import pytest
import torch
from blink_appliance.frontend.__main__ import logprobs_refusal
from blink_appliance.frontend.completion_service import CompletionService, ServiceLimits
from blink_appliance.frontend.errors import APIError
from blink_appliance.frontend.metrics import ServingMetrics
from blink_appliance.frontend.openai_schema import ChatCompletionRequest, CompletionRequest, parse_request

from tests.live_appliance import API_KEY, MODEL_NAME

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def hf(smollm2_gguf_path, smollm2_transformers):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name
    )
    return smollm2_transformers, tok


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_echo_scores_the_prompt_as_transformers_does(live, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    r = _client(live).completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([i]) for i in ids] and lp.token_logprobs[0] is None
    want = _hf_logprobs(model, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(want[p - 1, ids[p]])) < 1e-3
        top = lp.top_logprobs[p]
        assert tok.decode([int(want[p - 1].argmax())]) in top and lp.tokens[p] in top  # N = 1, plus the token
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens, strict=True))


def test_generated_logprobs_streamed_and_whole_agree_with_transformers(live, hf):
    model, tok = hf
    client = _client(live)
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    lp = whole.choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    # The second request may start from the first one's cached prompt blocks (prefix cache), whose
    # K/V came from another batch: the same values up to fp32 rounding.
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    ids = tok(PROMPT)["input_ids"]
    out = tok(whole.choices[0].text, add_special_tokens=False)["input_ids"]
    want = _hf_logprobs(model, ids + out)
    for i, t in enumerate(out[: len(lp.token_logprobs)]):
        assert abs(lp.token_logprobs[i] - float(want[len(ids) - 1 + i, t])) < 1e-3
        assert len(lp.top_logprobs[i]) == 3  # greedy: the chosen token is one of the three


def test_chat_logprobs_have_tokens_bytes_and_alternatives(live):
    client = _client(live)
    messages = [{"role": "user", "content": "Say hello in French."}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content
    )
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy
    text = bytes(b for c in content for b in c.bytes).decode("utf-8", "replace")
    assert text.startswith(whole.choices[0].message.content)  # a final EOS adds only its own bytes
    stream = client.chat.completions.create(**kw, stream=True)
    streamed = [c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # Up to fp32 rounding: the stream may start from the first request's cached prompt blocks.
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "cls, body, param, fragment",
    [
        (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
        (CompletionRequest, {"prompt": "x", "top_logprobs": 2}, "top_logprobs", "chat completions parameter"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens", "needs echo=true"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": 2},
            "logprobs",
            "valid boolean",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "needs logprobs",
        ),
    ],
)
def test_bad_logprob_parameters_are_400s(cls, body, param, fragment):
    with pytest.raises(APIError) as info:
        parse_request(cls, {"model": "m", **body})
    err = info.value.body()["error"]
    assert info.value.status == 400 and err["param"] == param and fragment in err["message"]


def _service(gguf_path, **refusals: str | None) -> CompletionService:
    from blink_appliance.model.tokenizer import Tokenizer

    limits = ServiceLimits("m", 512, 400, 64, 4, **refusals)
    metrics = ServingMetrics("m", engine_telemetry=dict, engine_alive=lambda: True)
    return CompletionService(None, Tokenizer.from_gguf(gguf_path), None, limits, metrics)


async def _refused(service: CompletionService, cls, body: dict) -> dict:
    req = parse_request(cls, {"model": "m", **body})
    prepare = service.prepare_completion if cls is CompletionRequest else service.prepare_chat
    with pytest.raises(APIError) as info:
        await prepare(req)
    assert info.value.status == 400
    return info.value.body()["error"]


async def test_an_appliance_without_a_logprob_area_refuses_logprobs(smollm2_gguf_path):
    assert logprobs_refusal(1 << 20) is None
    off = logprobs_refusal(0)
    assert "frontend.logprob_pairs = 0" in off
    service = _service(smollm2_gguf_path, logprobs_refusal=off)
    for cls, body in (
        (CompletionRequest, {"prompt": "x", "logprobs": 0}),
        (CompletionRequest, {"prompt": "x", "logprobs": 2, "echo": True}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}),
    ):
        err = await _refused(service, cls, body)
        assert err["message"] == off and err["param"] == "logprobs"
    ok = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "echo": True})
    assert (await service.prepare_completion(ok)).echo == "x"  # echo alone needs no logprobs


def test_lm_eval_local_completions_request_scores_as_transformers(live, hf):
    """The body lm-evaluation-harness's local-completions sends for a log-likelihood request, and
    how it reads the answer (bench/lm_eval_parity.py runs the harness itself)."""
    import json
    import urllib.request

    model, tok = hf
    context = tok("The quick brown fox jumps over the lazy", add_special_tokens=False)["input_ids"]
    ids = context + tok(" dog", add_special_tokens=False)["input_ids"]
    body = {"model": MODEL_NAME, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    req = urllib.request.Request(
        live.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        (choice,) = json.loads(r.read())["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's and the one generated token's
    scored = lp["token_logprobs"][len(context) : -1]
    want = _hf_logprobs(model, ids)
    assert abs(sum(scored) - sum(float(want[p - 1, ids[p]]) for p in range(len(context), len(ids)))) < 1e-3
    for i in range(len(context), len(ids)):  # the harness's greedy test: an exact float comparison
        assert (lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())) == (
            int(want[i - 1].argmax()) == ids[i]
        )
