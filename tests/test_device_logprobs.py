"""The GPU loop's logprob rows (engine/loop/logprobs.py, kernels/logprobs.py) against the reference's
(engine/reference/logprobs.py) over the same logits, written into a ring region's logprob area.
Without a GPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.sampling import SAMPLER_GREEDY, SAMPLER_LOGPROBS, SAMPLER_REJECTION  # noqa: E402

from blink_appliance.engine.loop.logprobs import DeviceLogprobs  # noqa: E402
from blink_appliance.engine.loop.sampler import DeviceSampler  # noqa: E402
from blink_appliance.engine.reference.logprobs import token_logprobs  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import LOGPROB_PAIR, RingGeometry, RingLayout  # noqa: E402
from tests.test_device_sampler import DEVICE, load_rows, make_state  # noqa: E402

GEOMETRY = RingGeometry(
    request_slots=4, arena_tokens=64, max_prompt_tokens=32, max_inflight=8, max_output_tokens=16,
    max_stop_ids=2, logprob_pairs=512,
)  # fmt: skip


def _ring() -> tuple[torch.Tensor, RingLayout]:
    layout = RingLayout.of(GEOMETRY)
    return torch.zeros(layout.size, dtype=torch.uint8, device=DEVICE), layout


def _rows(ring: torch.Tensor, layout: RingLayout, first: int, width: int) -> np.ndarray:
    raw = ring.cpu().numpy()[layout.logprob_pair(first) : layout.logprob_pair(first + width)]
    return raw.view(LOGPROB_PAIR)


@pytest.mark.parametrize("vocab", [300, 5000])  # one chunk; several, the last one partial
def test_rows_equal_the_reference_and_only_askers_get_them(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 5
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1  # a tie at the top: the lower id first
    params = [
        SamplingParams(temperature=0.0, seed=0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, seed=2),
        SamplingParams(temperature=0.0, seed=0),
        SamplingParams(temperature=0.9, seed=3),
    ]
    top_n = [3, 0, 20, -1, 5]  # row 3 asks for none
    offsets = [0, 40, 80, 200, 300]
    output_index = [2, 0, 1, 0, 4]
    state = make_state(rows, vocab)
    load_rows(state, params, output_index)
    state.lp_top_n[:rows] = torch.tensor(top_n, dtype=torch.int32)
    state.lp_offset[:rows] = torch.tensor(offsets)
    ring, layout = _ring()
    buf = logits.to(DEVICE).contiguous()
    sampler = DeviceSampler(state, buf, logprobs=DeviceLogprobs(state, buf, ring, layout))
    state.sampler_index.fill_(SAMPLER_REJECTION + SAMPLER_LOGPROBS)
    sampler.run()
    sampled = state.sampled.cpu()
    want = token_logprobs(logits, state.row_temperature.cpu(), sampled, [max(n, 0) for n in top_n])
    for r in range(rows):
        n = top_n[r]
        first = offsets[r] + output_index[r] * (1 + max(n, 0))
        got = _rows(ring, layout, first, 1 + max(n, 0))
        if n < 0:
            assert (got["token"] == 0).all() and (got["logprob"] == 0).all()  # nothing written
            continue
        assert got["token"][0] == sampled[r] == want[r].token_id
        assert abs(got["logprob"][0] - want[r].logprob) < 1e-4
        assert got["token"][1:].tolist() == [t for t, _ in want[r].top]
        assert np.allclose(got["logprob"][1:], [lp for _, lp in want[r].top], atol=1e-4)
    assert _rows(ring, layout, 0, 512)["token"].nonzero()[0].size > 0


def test_the_variants_without_logprobs_write_nothing():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    state = make_state(2, 300)
    load_rows(state, [SamplingParams(temperature=0.0, seed=0)] * 2, [0, 0])
    state.lp_top_n[:2] = 4
    ring, layout = _ring()
    buf = logits.to(DEVICE).contiguous()
    sampler = DeviceSampler(state, buf, logprobs=DeviceLogprobs(state, buf, ring, layout))
    assert len(sampler.variants()) == 2 * SAMPLER_LOGPROBS
    state.sampler_index.fill_(SAMPLER_GREEDY)
    sampler.run()
    assert not ring.any()
    state.sampler_index.fill_(SAMPLER_GREEDY + SAMPLER_LOGPROBS)
    sampler.run()
    assert ring.any()
