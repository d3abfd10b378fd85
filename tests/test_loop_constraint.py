"""Structured output in the GPU loop against the CPU reference engine: the mask kernel row for row
against engine/reference/constraint.py, the schedule twin (automata copied at admission, states
advanced by the sampled tokens), and constrained streams through the loop equal to the reference
engine's, greedy and sampled, with logprobs and penalties."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.constraint import mask_rows  # noqa: E402

from blink_appliance.engine.reference.constraint import allowed_tokens, mask_constrained  # noqa: E402
from blink_appliance.engine.reference.sequence import Sequence  # noqa: E402
from blink_appliance.model.loaders import build_model  # noqa: E402
from blink_appliance.wire.automaton import TokenAutomaton  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.scheduler_twin import Twin, unmap_rings  # noqa: E402, F401 (unmap_rings: autouse fixture)
from tests.test_loop_step import (  # noqa: E402
    HAVE_GPU_STACK,
    SAMPLED,
    TARGETS,
    checkpoint,
    greedy,
    prompt,
    reference_events,
    run_workload,
)
from tests.twin_front_end import LOOP  # noqa: E402
from tests.twin_front_end import prompt as twin_prompt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EOS = (2,)


def random_automaton(seed: int, vocab: int = 512, states: int = 6, width: int = 40) -> TokenAutomaton:
    """States with `width` random tokens each (never EOS), leading to random states; every state
    reaches an accepting one (the last), which also keeps some edges."""
    rng = random.Random(seed)
    transitions = {
        s: {t: rng.randrange(states) for t in rng.sample(range(3, vocab), width)} for s in range(states)
    }
    return TokenAutomaton.from_transitions(0, transitions, {states - 1, rng.randrange(states)}, set(EOS))


def test_the_mask_kernel_keeps_what_the_reference_keeps():
    automaton = random_automaton(1)
    words = torch.tensor(automaton.to_words(), dtype=torch.int32, device=DEVICE)
    arena = torch.zeros(100 + words.numel(), dtype=torch.int32, device=DEVICE)
    arena[100:] = words
    rows, vocab = 7, 512
    logits = torch.randn(rows, vocab, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 5, 1, 2, 4], dtype=torch.int32, device=DEVICE)  # row 1 unused
    c_offset = torch.tensor([100, -1, 100, 100, 100, 100], dtype=torch.int64, device=DEVICE)  # slot 1: none
    c_state = torch.tensor([0, 0, 1, 2, 3, 5], dtype=torch.int32, device=DEVICE)
    eos = torch.tensor([*EOS, -1, -1, -1, -1, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    got = logits.clone()
    n_rows = torch.tensor([rows], dtype=torch.int32, device=DEVICE)
    mask_rows(got, n_rows, slots, c_offset, c_state, arena, eos, chunk=128, programs=5, steps=11)
    seqs = []
    for slot in slots.tolist():
        constrained = slot >= 0 and int(c_offset[slot]) >= 0
        params = SamplingParams(constraint=automaton if constrained else None)
        seq = Sequence(0, [5], 1, params, 0, 0, 0, constraint_state=int(c_state[max(slot, 0)]))
        seqs.append(seq)
    want = mask_constrained(logits.cpu(), seqs, EOS)
    want[1] = logits[1].cpu()  # an unused row is left alone
    assert torch.equal(got.cpu(), want)
    accepting = [s for s in range(automaton.num_states) if automaton.accepting[s]]
    assert any(int(c_state[slots[r]]) in accepting for r in (0, 2, 3, 4, 5, 6)), "test premise: EOS kept"
    assert len(allowed_tokens(seqs[0], EOS)) < vocab


def test_the_twin_copies_automata_and_moves_their_states():
    """Constrained records beside plain ones, under KV pressure: the twin compares each slot's
    automaton offset and state with the reference's after every step (advanced by the tokens)."""
    t = Twin(dataclasses.replace(LOOP, num_kv_blocks=12))
    for i in range(6):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=6)
        if i % 3 != 2:
            params = dataclasses.replace(params, constraint=random_automaton(10 + i))
        t.front.submit(twin_prompt(5 + 2 * i, i), params)
    t.run_until_idle()
    assert [code for _, _, code in t.stats.finishes] == [0] * 6
    assert int(t.state.c_offset[0]) >= 0 or int(t.state.c_offset[1]) >= 0


def until_eos(n: int, **kw) -> SamplingParams:
    return dataclasses.replace(greedy(n, **kw), ignore_eos=False)


CONSTRAINED = [
    ("greedy", 0, prompt(1, 6), until_eos(10)),
    ("sampled", 0, prompt(2, 9), dataclasses.replace(SAMPLED, ignore_eos=False, max_tokens=12)),
    ("logprobs", 1, prompt(3, 5), until_eos(8, logprobs=3)),
    ("penalized", 1, prompt(4, 7), until_eos(8, repetition_penalty=0.5, presence_penalty=1.0)),
    ("plain", 0, prompt(5, 8), greedy(8)),
]


@pytest.mark.parametrize("target", TARGETS)
async def test_loop_constrained_streams_equal_the_reference_engine(target):
    if target.startswith("cuda") and not HAVE_GPU_STACK:
        pytest.skip("needs cupy and cuda-bindings (the GPU extra)")
    workload = [
        (
            name,
            at,
            tokens,
            params if name == "plain" else dataclasses.replace(params, constraint=random_automaton(i)),
        )
        for i, (name, at, tokens, params) in enumerate(CONSTRAINED)
    ]
    streams, _, _ = await run_workload(workload, target=target)
    model = build_model(checkpoint(), torch.float32, "cpu")
    for name, _, tokens, params in workload:
        want = reference_events(model, tokens, params)
        got = [e for e in streams[name] if e.token_id is not None]
        assert [e.token_id for e in got] == [e.token_id for e in want], name
        if params.logprobs is not None:
            assert all(
                abs(g.logprobs.logprob - w.logprobs.logprob) < 1e-3 for g, w in zip(got, want, strict=True)
            )
        automaton, state = params.constraint, None
        if automaton is not None:  # the stream follows its automaton (and ends only where it accepts)
            state = automaton.initial
            for e in got:
                if e.token_id in EOS:
                    assert automaton.accepting[state] and e.finished
                else:
                    state = automaton.advance(state, e.token_id)
                    assert state is not None, name
