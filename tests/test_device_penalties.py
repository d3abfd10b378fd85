"""The GPU loop's penalties (engine/loop/penalties.py, kernels/penalties.py) against the reference's
(engine/reference/penalties.py) on the same logits and tokens. Without a GPU the kernel runs under
the Triton interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.engine.loop.penalties import DevicePenalties  # noqa: E402
from blink_appliance.engine.loop.state import DeviceState, LoopGeometry  # noqa: E402
from blink_appliance.engine.reference.penalties import penalize  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, MAX_LEN = 3000, 700


def _state(rows: int) -> DeviceState:
    g = LoopGeometry(
        num_slots=rows + 2, max_num_seqs=rows, max_num_batched_tokens=max(rows, 8), buckets=(max(rows, 8),),
        block_size=4, num_kv_blocks=256, max_model_len=MAX_LEN, max_stop_ids=2, vocab_size=VOCAB,
        eos_token_ids=(), max_logit_bias=300,
    )  # fmt: skip
    return DeviceState.allocate(g, DEVICE)


def test_rows_are_penalized_as_the_reference_penalizes_them():
    gen = torch.Generator().manual_seed(0)
    cases = [  # (params, prompt length, generated length); tokens repeat often (a small id range)
        (SamplingParams(repetition_penalty=1.3), 40, 30),
        (SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), 25, 600),  # several token tiles
        (SamplingParams(), 10, 5),  # not penalized: untouched
        (SamplingParams(logit_bias=tuple((int(t), float(b)) for t, b in zip(
            torch.randperm(VOCAB, generator=gen)[:300], torch.linspace(-100, 100, 300), strict=True))), 12, 4),
        (SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0,
                        logit_bias=((5, 3.0), (9, -2.5))), 300, 299),
    ]  # fmt: skip
    rows = len(cases)
    state = _state(rows)
    logits = torch.randn(rows, VOCAB, generator=gen) * 4
    want = logits.clone()
    slots = [rows + 1, 0, 3, 1, 2]  # rows need not sit in their slots' order
    for r, ((params, n_prompt, n_gen), slot) in enumerate(zip(cases, slots, strict=True)):
        tokens = torch.randint(0, 200, (n_prompt + n_gen,), generator=gen)
        penalize(want[r], params, tokens[:n_prompt].tolist(), tokens[n_prompt:].tolist())
        state.sample_slot[r] = slot
        state.token_ids[slot, : len(tokens)] = tokens.to(torch.int32)
        state.num_tokens[slot], state.prompt_len[slot] = len(tokens), n_prompt
        state.penalized[slot] = int(params.penalized)
        state.presence_penalty[slot] = params.presence_penalty
        state.frequency_penalty[slot] = params.frequency_penalty
        state.repetition_penalty[slot] = params.repetition_penalty
        state.n_bias[slot] = len(params.logit_bias)
        for j, (t, b) in enumerate(params.logit_bias):
            state.bias_ids[slot, j], state.bias_values[slot, j] = t, b
    state.num_sample_rows.fill_(rows)
    buf = logits.to(DEVICE).contiguous()
    penalties = DevicePenalties(state, buf)
    penalties.launch()
    assert torch.equal(buf.cpu(), want)  # the same fp32 operations, bit for bit
    assert not penalties.counts.any()  # the counts are left at 0 for the next step
    penalties.launch()  # a second step on the same logits penalizes again, from clean counts
    for r, (params, n_prompt, n_gen) in enumerate(cases):
        tokens = state.token_ids[slots[r], : n_prompt + n_gen].cpu()
        penalize(want[r], params, tokens[:n_prompt].tolist(), tokens[n_prompt:].tolist())
    assert torch.equal(buf.cpu(), want)
