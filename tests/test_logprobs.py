"""Logprobs in the CPU reference engine against HF transformers on the same SmolLM2 weights, and the
logprob area's allocation and ring round trip (docs/api.md and docs/protocol.md, "Logprobs")."""

from __future__ import annotations

import math

import pytest
import torch

from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
from blink_appliance.engine.reference.logprobs import token_logprobs, top_tokens
from blink_appliance.wire.logprob_area import LogprobArea
from blink_appliance.wire.request import Request, SamplingParams, TokenEvent

PROMPT = "The capital of France is Paris. The capital of Italy is"


def _run(model, requests: list[Request], **config: int) -> dict[int, list[TokenEvent]]:
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=256, **config))
    for r in requests:
        engine.add_request(r)
    events: dict[int, list[TokenEvent]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for e in engine.step():
            events[e.request_id].append(e)
    return events


def _hf_logprobs(hf, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token at position p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _check_row(row, hf_row: torch.Tensor, n: int) -> None:
    assert abs(row.logprob - float(hf_row[row.token_id])) < 1e-3
    assert len(row.top) == n
    want = hf_row.topk(n)
    # Same tokens (a near-tie may swap places between the two implementations), same values.
    assert {t for t, _ in row.top} == set(want.indices.tolist()) or n == 0
    for (_, lp), hf_lp in zip(row.top, want.values.tolist(), strict=True):
        assert abs(lp - hf_lp) < 1e-3
    assert [lp for _, lp in row.top] == sorted((lp for _, lp in row.top), reverse=True)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generated_and_prompt_logprobs_equal_transformers(smollm2_models, temperature):
    ckpt, model, hf = smollm2_models
    ids = ckpt.tokenizer.encode(PROMPT)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=6, logprobs=5, prompt_logprobs=True, ignore_eos=True
    )
    # A step budget of 8 splits the prompt's prefill over chunks: every position is scored once.
    events = _run(model, [Request(1, ids, params)], max_num_batched_tokens=8, max_num_seqs=1)[1]
    out = [e.token_id for e in events]
    hf_lp = _hf_logprobs(hf, ids + out, temperature)
    prompt = events[0].prompt_logprobs
    assert prompt is not None and [r.token_id for r in prompt] == ids[1:]
    assert all(e.prompt_logprobs is None for e in events[1:])
    for p, row in enumerate(prompt, start=1):
        _check_row(row, hf_lp[p - 1], 5)
    for i, e in enumerate(events):
        assert e.logprobs is not None and e.logprobs.token_id == e.token_id
        _check_row(e.logprobs, hf_lp[len(ids) - 1 + i], 5)
    if temperature == 0.0:  # greedy: the chosen token is the most likely one
        assert all(e.logprobs.top[0][0] == e.token_id for e in events)


def test_logprobs_do_not_change_tokens_and_only_askers_get_them(smollm2_models):
    ckpt, model, _ = smollm2_models
    ids = ckpt.tokenizer.encode(PROMPT)
    plain = SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    asking = SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True, logprobs=0)
    events = _run(model, [Request(1, ids, plain), Request(2, ids, asking)], max_num_batched_tokens=128)
    assert [e.token_id for e in events[1]] == [e.token_id for e in events[2]]
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in events[1])
    assert all(e.logprobs is not None and e.logprobs.top == () for e in events[2])
    assert events[2][0].prompt_logprobs is None  # not asked


def test_top_tokens_break_ties_by_lower_id():
    row = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    ids, values = top_tokens(row, 2)
    assert ids == [[1, 3]] and values == [[2.0, 2.0]]
    lps = token_logprobs(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([2.0]), torch.tensor([0]), [3])[0]
    want = torch.log_softmax(torch.tensor([0.5, 1.0, 1.5]), -1)
    assert math.isclose(lps.logprob, float(want[0]), abs_tol=1e-6)
    assert [t for t, _ in lps.top] == [2, 1, 0]


def test_sampling_params_refuse_bad_logprobs():
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        SamplingParams(prompt_logprobs=True).validate()


def test_logprob_area_first_fit_merges_and_waits_for_unknown_ranges():
    area = LogprobArea(100)
    assert area.reserve(0, 40) == 0 and area.reserve(1, 30) == 40 and area.reserve(2, 30) == 70
    assert area.reserve(3, 1) is None  # full
    area.release(1)
    assert area.reserve(3, 31) is None and area.reserve(3, 20) == 40  # first fit in the hole
    area.release(0)
    area.release(3)
    area.release(2)
    assert area.free_units == 100 and area.reserve(4, 100) == 0  # the ranges merged back into one
    area.release(4)
    area.adopt({7, 9})  # a previous front end's channels: where their rows are is unknown
    assert area.reserve(5, 1) is None
    area.release(7)
    assert area.reserve(5, 1) is None
    area.release(9)
    assert area.reserve(5, 1) == 0
