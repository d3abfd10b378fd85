"""Logprobs in the GPU loop against the CPU reference engine, on the harness of test_loop_step.py:
the sampled tokens' (with penalties and biases), and the prompt's (echo: Scheduler phase 6, one
sequence scored a step in chunks of prompt_score_chunk, across preemption)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.state import COUNTER_INDEX  # noqa: E402
from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.model.loaders import build_model  # noqa: E402
from blink_appliance.wire.request import Request  # noqa: E402
from tests.test_loop_step import (  # noqa: E402
    ENGINE,
    GEOMETRY,
    HAVE_GPU_STACK,
    SAMPLED,
    TARGETS,
    _close,
    checkpoint,
    greedy,
    prompt,
    reference_events,
    run_workload,
)

LOGPROB_WORKLOAD = [
    ("lp-greedy", 0, prompt(7, 6), greedy(6, logprobs=3)),
    ("lp-sampled", 0, prompt(3, 7), dataclasses.replace(SAMPLED, logprobs=5)),
    ("lp-chunked", 1, prompt(2, 21), greedy(4, logprobs=0)),  # prefilled over steps
    ("plain", 1, prompt(5, 9), greedy(5)),
    # Penalties and biases change the logits the sampler and the logprobs read.
    ("repetition", 0, prompt(8, 5), greedy(10, repetition_penalty=0.3)),
    (
        "presence-frequency",
        1,
        prompt(9, 6),
        greedy(10, presence_penalty=1.5, frequency_penalty=1.0, logprobs=2),
    ),
    ("biased-sampled", 2, prompt(10, 5), dataclasses.replace(SAMPLED, logit_bias=((17, 8.0), (99, 5.0)))),
    # n = 4 as the front end sends it: four requests of one prompt on seeds seed + i.
    *((f"choice-{i}", 1, prompt(11, 6), dataclasses.replace(SAMPLED, seed=50 + i)) for i in range(4)),
]


@pytest.mark.parametrize("target", TARGETS)
async def test_loop_logprobs_and_penalties_equal_the_reference_engine(target):
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    model = build_model(checkpoint(), torch.float32, "cpu")
    streams, _, _ = await run_workload(LOGPROB_WORKLOAD, target=target)
    for name, _, tokens, params in LOGPROB_WORKLOAD:
        want = reference_events(model, tokens, params)
        got = [e for e in streams[name] if e.token_id is not None]
        assert [e.token_id for e in got] == [e.token_id for e in want], name
        if params.penalized:  # the penalties changed the stream (else the test would not see them)
            plain = dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0,
                                        repetition_penalty=1.0, logit_bias=())  # fmt: skip
            engine = LLMEngine(model, EngineConfig(seed=0, **ENGINE))
            assert engine.generate([Request(0, tokens, plain)])[0] != [e.token_id for e in want], name
        for g, w in zip(got, want, strict=True):
            if params.logprobs is None:
                assert g.logprobs is None and w.logprobs is None
                continue
            assert g.logprobs.token_id == w.logprobs.token_id
            assert abs(g.logprobs.logprob - w.logprobs.logprob) < 1e-3, name
            assert [t for t, _ in g.logprobs.top] == [t for t, _ in w.logprobs.top], name
            assert all(
                abs(a - b) < 1e-3 for (_, a), (_, b) in zip(g.logprobs.top, w.logprobs.top, strict=True)
            )


# Prompt logprobs (echo): scored 4 positions a step at most, one sequence a step; a scoring head
# waits while another scores; KV pressure preempts, and recompute scores nothing twice.
ECHO_GEOMETRY = dataclasses.replace(GEOMETRY, prompt_score_chunk=4)
ECHO_WORKLOAD = [
    ("echo-long", 0, prompt(2, 21), greedy(3, logprobs=2, prompt_logprobs=True)),
    ("echo-one", 0, prompt(7, 6), greedy(1, logprobs=0, prompt_logprobs=True)),
    ("plain", 0, prompt(5, 9), greedy(6)),
    ("plain-long", 1, prompt(9, 20), greedy(14)),
    ("echo-sampled", 1, prompt(3, 11), dataclasses.replace(SAMPLED, logprobs=3, prompt_logprobs=True)),
    ("late", 2, prompt(8, 7), greedy(8, logprobs=1)),
]


@pytest.mark.parametrize("target", TARGETS)
async def test_loop_prompt_logprobs_equal_the_reference_engine(target):
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    model = build_model(checkpoint(), torch.float32, "cpu")
    streams, loop, _ = await run_workload(ECHO_WORKLOAD, target=target, geometry=ECHO_GEOMETRY)
    for name, _, tokens, params in ECHO_WORKLOAD:
        want = reference_events(model, tokens, params)
        got = [e for e in streams[name] if e.token_id is not None]
        assert [e.token_id for e in got] == [e.token_id for e in want], name
        assert all(_close(g.logprobs, w.logprobs) for g, w in zip(got, want, strict=True)), name
        if not params.prompt_logprobs:
            assert got[0].prompt_logprobs is None, name
            continue
        scored = got[0].prompt_logprobs
        assert [p.token_id for p in scored] == tokens[1:], name
        assert all(_close(g, w) for g, w in zip(scored, want[0].prompt_logprobs, strict=True)), name
    assert int(loop.state.counters[COUNTER_INDEX["preemptions"]]) > 0, "KV pressure should preempt"
