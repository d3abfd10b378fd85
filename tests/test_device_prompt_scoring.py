"""Prompt scoring (prompt logprobs, `echo`) in the device loop's schedule step against the CPU
reference, step by step (tests/scheduler_twin.py): one sequence scores a step, in chunks of at most
prompt_score_chunk tokens; a scoring head waits while another scores; the scored positions' token
rows, targets and logprob rows; each slot's next position to score, across preemption and recompute.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.twin_front_end import LOOP, RING, prompt  # noqa: E402


def scoring_workload(t: Twin, seed: int, steps: int = 40) -> int:
    """Requests with and without prompt logprobs (greedy and sampled, two classes, some sharing a
    prefix), arriving at random; cancels; then run to completion. Returns the steps that scored."""
    rng = random.Random(seed)
    live = []
    region = t.front.regions[0]
    scored = 0
    shared = prompt(13, 7)
    for i in range(steps + 400):
        if i < steps:
            for _ in range(rng.choice([0, 1, 1, 2])):
                if not any(region.load_ctl(c, "generation") == region.load_progress(c, "done")
                           for c in range(RING.max_inflight)):  # fmt: skip
                    break
                p = rng.choice([shared, []])[: rng.randint(4, 13)] + prompt(
                    rng.randint(1, 14), rng.randint(0, 999)
                )
                params = SamplingParams(
                    temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99), max_tokens=rng.randint(1, 6),
                    logprobs=rng.choice([None, 0, 2]),
                )  # fmt: skip
                if params.logprobs is not None and rng.random() < 0.7:
                    params = dataclasses.replace(params, prompt_logprobs=True)
                live.append(t.front.submit(p[:28], params, priority=rng.choice([0, 0, 2])))
            if live and rng.random() < 0.05:
                t.front.cancel(live.pop(rng.randrange(len(live))))
        elif not t.engine.has_unfinished() and region.load("req_head") == region.load("req_tail"):
            break
        scored += bool(t.step().scored)
    assert int(t.state.num_active) == 0
    return scored


@pytest.mark.parametrize(("seed", "cache", "limit"), [(1, False, -1), (2, True, 0), (3, True, 2)])
def test_prompt_scoring_matches_reference_step_by_step(seed, cache, limit):
    loop = dataclasses.replace(
        LOOP,
        num_kv_blocks=14,
        max_num_seqs=4,
        prompt_score_chunk=5,
        prefix_cache=cache,
        lower_class_limit=limit,
    )
    t = Twin(loop)
    scored = scoring_workload(t, seed)
    assert scored > 10, "the workload must score prompts"
    assert t.stats.preemptions > 0, "and preempt"


def test_a_scoring_head_waits_while_another_sequence_scores():
    t = Twin(dataclasses.replace(LOOP, prompt_score_chunk=3))
    scoring = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=True)
    t.front.submit(prompt(10, 1), scoring)
    t.front.submit(prompt(6, 2), scoring)
    t.front.submit(prompt(4, 3), SamplingParams(temperature=0.0, max_tokens=2))
    chunks = [[(c.request_id, c.num_tokens) for c in t.step().chunks] for _ in range(4)]
    # 3 positions a step for the first; the second (and the plain one behind it) wait until the
    # first has scored all of its prompt.
    assert chunks == [[(1, 3)], [(1, 3)], [(1, 3)], [(1, 1), (2, 3), (3, 4)]]
    t.run_until_idle()
