"""Penalties and logit_bias in the CPU reference engine against HF transformers' logits processors
(SequenceBiasLogitsProcessor with one-token sequences, RepetitionPenaltyLogitsProcessor) and OpenAI's
presence / frequency formula, on SmolLM2 in fp32 (docs/engine.md, "Penalties")."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
from blink_appliance.engine.reference.penalties import penalize
from blink_appliance.wire.request import Request, SamplingParams

PROMPT = "List the colours of the rainbow, then list them again:"


def _hf_greedy(hf, ids: list[int], params: SamplingParams, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by transformers with its processors in the engine's order, then OpenAI's
    presence / frequency penalties on the generated tokens; the processed logits of each step."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    out, seen = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            scores = processors(torch.tensor([out]), hf(torch.tensor([out])).logits[:, -1].float())[0]
            for t, c in Counter(out[len(ids) :]).items():
                scores[t] -= params.frequency_penalty * c + params.presence_penalty
            seen.append(scores)
            out.append(int(scores.argmax()))
    return out[len(ids) :], seen


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(
            temperature=0.0, logit_bias=((28, 6.0), (314, -100.0), (1000, 2.5)), repetition_penalty=0.9
        ),
    ],
)
def test_greedy_streams_and_logprobs_equal_transformers_processors(smollm2_models, params):
    ckpt, model, hf = smollm2_models
    ids = ckpt.tokenizer.encode(PROMPT)
    n = 12
    params = SamplingParams(**{**params.__dict__, "max_tokens": n, "ignore_eos": True, "logprobs": 2})
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_model_len=256))
    engine.add_request(Request(1, ids, params))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    want, scores = _hf_greedy(hf, ids, params, n)
    assert [e.token_id for e in events] == want
    raw = []
    for e, s in zip(events, scores, strict=True):  # logprobs are of the penalized distribution
        assert abs(e.logprobs.logprob - float(torch.log_softmax(s, -1)[e.token_id])) < 1e-3
        with torch.no_grad():
            logits = hf(torch.tensor([ids + want[: len(raw)]])).logits[0, -1]
        raw.append(float(torch.log_softmax(logits, -1)[e.token_id]))
    # The penalties moved the distribution (else this test would not see them).
    assert max(abs(e.logprobs.logprob - r) for e, r in zip(events, raw, strict=True)) > 0.05


def test_penalize_follows_the_documented_order_and_counts():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(logit_bias=((0, 1.0), (4, 3.0)), repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)  # fmt: skip
    penalize(x, params, prompt=[1, 4], generated=[2, 2, 3])
    # bias: [3, -1, .5, 3, 1]; repetition over {1, 2, 3, 4}: [3, -2, .25, 1.5, .5];
    # frequency / presence over {2: 2, 3: 1}: 2 -> .25 - 1.25, 3 -> 1.5 - .75.
    assert x.tolist() == [3.0, -2.0, -1.0, 0.75, 0.5]
