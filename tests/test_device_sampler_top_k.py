"""The device sampler's rows with top-k (engine/loop/sampler.py `rejection_top_k` and
`rejection_top_k_top_p`) against the reference sampler: the count and cut of top-k alone, and with
top-p the bounds of the top-k set's mass and the select of its threshold (kernels/sampling_select.py).
Without a GPU the kernels run under the interpreter, as in tests/test_device_sampler.py, whose helpers
these use."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.sampling import SAMPLER_REJECTION_TOP_K, SAMPLER_REJECTION_TOP_K_TOP_P  # noqa: E402
from blink_appliance.kernels.sampling_gather import GATHER_CAP  # noqa: E402
from blink_appliance.kernels.sampling_select import GATHERING, SELECT_LEVELS  # noqa: E402

from tests.test_device_sampler import (  # noqa: E402
    DEVICE,
    DeviceSampler,
    SamplingParams,
    load_rows,
    make_state,
    random_params,
    reference,
    run_device,
    variant_for,
)

LEVELS = SELECT_LEVELS.value  # a select's level field once its threshold is known
GATHERED = GATHERING.value  # and once the row gathered its candidates


@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("vocab,chunk", [(300, 64), (1000, 128)])
def test_rejection_variant_equals_reference_with_top_k_alone(vocab, chunk, rounds):
    """Rows with top-k but no top-p (with temperature and min-p) take the rejection variant compiled
    with top-k, beside rows with top-p alone: a winner is kept when fewer than top_k tokens lie
    strictly above it, so ties at the k-th value are all kept, as the reference keeps them. Flat rows
    make the first winners miss small top-k sets, so races repeat and rows reach the finisher; rows of
    equal logits tie across the threshold."""
    gen = torch.Generator().manual_seed(vocab + 10 * rounds)
    rows = 48
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::4] *= 0.02
    logits[1::6] = torch.randint(0, 4, (vocab,), generator=gen).float()  # few distinct values: ties
    params = [dataclasses.replace(p, top_p=1.0) if p.top_k else p for p in random_params(gen, rows, vocab)]
    params[0] = SamplingParams(temperature=1.0, top_k=3, seed=9)
    assert any(p.top_k > 0 and not p.greedy for p in params)
    assert any(p.top_p < 1.0 and not p.greedy for p in params)
    assert variant_for(params) == SAMPLER_REJECTION_TOP_K
    index = torch.randint(0, 500, (rows,), generator=gen).tolist()
    got = run_device(
        logits, params, index, SAMPLER_REJECTION_TOP_K, rejection_chunk=chunk, rejection_rounds=rounds
    )
    want = reference(logits, params, index)
    assert torch.equal(got, want), [(r, params[r]) for r in range(rows) if got[r] != want[r]]


@pytest.mark.parametrize("gather_cap", [0, GATHER_CAP])
@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("vocab,chunk", [(300, 64), (1000, 128)])
def test_rejection_variant_equals_reference_with_top_k_and_top_p(vocab, chunk, rounds, gather_cap):
    """Rows with both (the random mix of every filter, so beside top-k or top-p alone): the reference
    normalises the nucleus over the top-k set. Flat rows leave the bound test undecided, so selects
    run (and with one round the finisher selects itself) and, with a gather cap, rows whose kept bin
    leaves few candidates are decided from them; integer rows tie at the k-th value."""
    gen = torch.Generator().manual_seed(vocab + 100 * rounds)
    rows = 48
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::4] *= 0.02
    logits[1::6] = torch.randint(0, 4, (vocab,), generator=gen).float()  # few distinct values: ties
    params = random_params(gen, rows, vocab)
    params[:4] = [
        SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=9 + k)
        for k, p in ((40, 0.9), (5, 0.5), (200, 0.99), (vocab - 1, 0.9))
    ]
    assert sum(p.top_k > 0 and p.top_p < 1.0 and not p.greedy for p in params) >= 8
    assert variant_for(params) == SAMPLER_REJECTION_TOP_K_TOP_P
    index = torch.randint(0, 500, (rows,), generator=gen).tolist()
    state = make_state(rows, vocab)
    load_rows(state, params, index)
    sampler = DeviceSampler(
        state,
        logits.to(DEVICE),
        rejection_chunk=chunk,
        rejection_rounds=rounds,
        rejection_gather_cap=gather_cap,
    )
    sampler.rejection_top_k_top_p()
    got, want = state.sampled[:rows].cpu(), reference(logits, params, index)
    assert torch.equal(got, want), [(r, params[r]) for r in range(rows) if got[r] != want[r]]
    levels = sampler._rejection.select[:rows, 2]
    if rounds > 1:  # some rows' selects ran in the chunked passes, and some gathered
        assert (levels == (GATHERED if gather_cap else LEVELS)).any()
    if not gather_cap:
        assert not (levels == GATHERED).any()


def test_top_k_threshold_select_equals_the_kth_largest():
    """The select alone, level by level through the queue: on rows of few distinct values (ties at
    the threshold), of -0.0 beside 0.0, of -inf and of negatives, its threshold key is the k-th
    largest x's."""
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 8, 500
    logits = torch.randn(rows, vocab, generator=gen) * 0.01
    logits[1] = torch.randint(-3, 3, (vocab,), generator=gen).float()
    logits[2, ::2], logits[2, 1::2] = 0.0, -0.0
    logits[2, :7] = 1.0
    logits[3, 100:] = float("-inf")
    logits[4] = -torch.rand(vocab, generator=gen) - 1.0
    top_k = [37, 100, 9, 120, 250, 1, 2, 499]
    params = [SamplingParams(temperature=0.5, top_k=k, top_p=0.3, seed=r) for r, k in enumerate(top_k)]
    state = make_state(rows, vocab)
    load_rows(state, params, list(range(rows)))
    sampler = DeviceSampler(
        state, logits.to(DEVICE), rejection_chunk=64, rejection_rounds=8, rejection_gather_cap=0
    )
    sampler.rejection_top_k_top_p()
    index = list(range(rows))
    assert torch.equal(state.sampled[:rows].cpu(), reference(logits, params, index))
    select = sampler._rejection.select[:rows].cpu()
    x = logits / 0.5
    for r, k in enumerate(top_k):
        if select[r, 2] != LEVELS:  # decided by the bounds: no select ran
            continue
        kth = x[r].topk(k).values[-1].item()
        key = torch.tensor([kth + 0.0]).view(torch.int32).item()  # -0.0 keys as 0.0
        key = key + 2**31 if key >= 0 else ~key
        at_or_above = x[r][x[r] >= kth].numel()
        assert select[r, 0].item() <= key, (r, k)
        # Every key from the threshold up is a token at or above the k-th largest (an early exit's
        # threshold lies below the k-th key, but no token lies between them).
        keys = x[r].view(torch.int32).long()
        keys = torch.where(x[r] == 0, 2**31, torch.where(keys >= 0, keys + 2**31, ~keys))
        assert int((keys >= select[r, 0]).sum()) == at_or_above, (r, k)
    assert (select[:, 2] == LEVELS).sum() >= 4, select


def both_step_as_reference(sampler, state, logits, params, index, variant="rejection_top_k_top_p"):
    """One step of the variant with both (or `variant`) at output indices `index`: every row's token is
    the reference's."""
    load_rows(state, params, index)
    getattr(sampler, variant)()
    got, want = state.sampled[: len(params)].cpu(), reference(logits, params, index)
    assert torch.equal(got, want), (index, [r for r in range(len(params)) if got[r] != want[r]])


def test_gathered_candidates_decide_as_the_reference():
    """Rows with both whose kept bin leaves few candidates are decided from them
    (kernels/sampling_gather.py): flat rows; a tie group at the threshold and one that top_p cuts
    (ranked by index inside it); a row mostly -inf; negative logits; and a min-p row beside them
    (its race keeps to the floor, so it is decided by a test, not from candidates).
    Over three steps (other output indices, so other race winners), each the reference's token."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 9, 2048
    logits = torch.randn(rows, vocab, generator=gen) * 0.5
    # A heavy tail, so that the first winner lies outside the set and the select runs.
    logits[4] = torch.rand(vocab, generator=gen) * 3
    logits[4, torch.randperm(vocab, generator=gen)[:35]] = torch.tensor([4.0] * 20 + [3.5] * 15)
    logits[5] = logits[4].flip(0)
    logits[6] = torch.randn(vocab, generator=gen) * 0.3 + 2.0
    logits[6, :20] = torch.rand(20, generator=gen) * 2 + 3
    logits[7] = float("-inf")
    logits[7, torch.randperm(vocab, generator=gen)[:50]] = torch.randn(50, generator=gen)
    logits[8] = -torch.rand(vocab, generator=gen) - 1.0
    top_k = [40, 10, 100, 200, 30, 25, 20, 40, 25]
    top_p = [0.9, 0.5, 0.95, 0.8, 0.5, 0.7, 0.99, 0.9, 0.7]
    min_p = [0.0] * 6 + [0.3, 0.0, 0.0]
    params = [
        SamplingParams(temperature=[0.7, 1.3][r % 2], top_k=top_k[r], top_p=top_p[r], min_p=min_p[r], seed=r)
        for r in range(rows)
    ]
    state = make_state(rows, vocab)
    sampler = DeviceSampler(state, logits.to(DEVICE), rejection_chunk=256, rejection_rounds=3)
    for step in range(3):
        both_step_as_reference(sampler, state, logits, params, [step * 11 + r for r in range(rows)])
        gathered = sampler._rejection.select[:rows, 2].cpu() == GATHERED
        assert gathered[:6].all() and gathered[7:].all(), (step, gathered)


def test_top_k_cut_settles_flat_rows_in_few_races():
    """On flat rows a rejected race winner alone only halves the region, so top_k 1-100 of 4096 would
    take up to 8 races and the finisher; the test's bins cut the region to the highest bins holding
    top_k tokens, and every row settles in at most 3 races, with the reference's tokens."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 8, 4096
    logits = torch.randn(rows, vocab, generator=gen) * 0.02
    params = [SamplingParams(temperature=1.0, top_k=[1, 4, 20, 100][r % 4], seed=r) for r in range(rows)]
    state = make_state(rows, vocab)
    sampler = DeviceSampler(state, logits.to(DEVICE), rejection_chunk=512, rejection_rounds=8)
    index = list(range(rows))
    load_rows(state, params, index)
    sampler.rejection_top_k()
    assert torch.equal(state.sampled[:rows].cpu(), reference(logits, params, index))
    races = sampler._rejection.races[:rows].cpu()
    assert (races <= 3).all(), races


@pytest.mark.parametrize("variant", ["rejection_top_k_top_p", "rejection_top_k"])
@pytest.mark.parametrize("gather_cap", [0, GATHER_CAP])
def test_top_k_rows_gather_at_their_kth_chunk_max(gather_cap, variant):
    """In either variant with top-k, a row with top_k no more than its chunks whose first winner lies
    below k chunk maxima skips its test: it gathers the tokens at or above its k-th largest chunk max,
    and the finisher decides it from them (kernels/sampling_gather.py), so flat rows with top-k alone
    and (in the variant with both) with top-p settle after one race. Beside them: a tie group across
    chunks at the k-th value, more tied maxima than the cap holds (the row falls back to its test), a
    row with more top_k than chunks, min-p, negative logits, a row mostly -inf and a greedy row. Over
    three steps, each the reference's token."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab, chunk = 14, 4096, 128  # 32 chunks
    logits = torch.randn(rows, vocab, generator=gen) * 0.05
    logits[4, torch.randperm(vocab, generator=gen)[:12]] = 0.4  # 12 tied tokens at the 5th to 16th
    logits[4, :4] = torch.tensor([0.9, 0.8, 0.7, 0.6])
    # Every chunk's max 0.1, and 1000 more: more tied candidates than the cap (top_k 3 keeps them all),
    # of less mass than the rest, so the first winner is mostly rejected
    for r in (5, 12, 13):
        logits[r] *= 0.2
        logits[r, torch.randperm(vocab, generator=gen)[:1000]] = 0.1
        logits[r, torch.arange(0, vocab, chunk)] = 0.1
    logits[8] = -torch.rand(vocab, generator=gen) - 1.0
    logits[9] = float("-inf")
    logits[9, torch.randperm(vocab, generator=gen)[:50]] = torch.randn(50, generator=gen)
    top_k = [1, 5, 20, 32, 8, 3, 40, 20, 10, 6, 16, 4, 3, 2]
    top_p = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.6, 0.9, 1.0, 0.5, 1.0, 1.0, 0.9]
    if variant == "rejection_top_k":  # rows of top-k alone
        top_p = [1.0] * rows
    min_p = [0.0] * 11 + [0.5, 0.0, 0.0]
    temperature = [0.7, 1.3, 1.0, 0.5, 1.0, 1.0, 1.0, 0.8, 1.1, 1.0, 0.9, 1.0, 1.0, 1.0]
    temperature[3] = 0.0  # greedy
    params = [
        SamplingParams(temperature=temperature[r], top_k=top_k[r], top_p=top_p[r], min_p=min_p[r], seed=r)
        for r in range(rows)
    ]
    state = make_state(rows, vocab)
    sampler = DeviceSampler(
        state, logits.to(DEVICE), rejection_chunk=chunk, rejection_rounds=3, rejection_gather_cap=gather_cap
    )
    overflowed = 0
    for step in range(3):
        both_step_as_reference(sampler, state, logits, params, [step * 7 + r for r in range(rows)], variant)
        races = sampler._rejection.races[:rows].cpu()
        flat = torch.tensor([0, 1, 2, 7, 10])  # winners outside their small top-k sets
        if gather_cap:
            assert (races[flat] == 1).all(), (step, races)
            for r in (5, 12, 13):  # a winner below the ties gathered them all: counted, not kept
                tied = int((logits[r] == 0.1).sum())
                assert sampler._rejection.gather[r, 1].item() in (0, tied) and tied > gather_cap, step
                overflowed += sampler._rejection.gather[r, 1].item() == tied
        else:
            assert (races[flat] > 1).all(), (step, races)
        assert races[6] > 1, (step, races)  # 40 > 32 chunks: no gathering
    assert overflowed >= 3 or not gather_cap
