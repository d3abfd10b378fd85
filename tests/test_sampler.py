"""The sampler and its counter-based RNG: definitions, filters, seed independence, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from blink_appliance.engine.reference.rng import _to_uniform, mix_int, uniform_int, uniforms
from blink_appliance.engine.reference.sampler import SamplingTensors, filter_mask, sample
from blink_appliance.wire.request import SamplingParams


def tensors(params: list[SamplingParams], seeds: list[int] | None = None, index: list[int] | None = None):
    seeds = seeds if seeds is not None else [p.seed or 0 for p in params]
    index = index if index is not None else [0] * len(params)
    return SamplingTensors.build(params, seeds, index, "cpu")


def test_rng_is_splitmix64_bit_for_bit():
    assert mix_int(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64(seed 0), first output
    seeds = [0, 1, 12345, 2**62 + 17, 2**63 - 1]
    index = [0, 3, 99, 2**31, 7]
    u = uniforms(torch.tensor(seeds), torch.tensor(index), 37)
    ref = torch.tensor([[uniform_int(s, n, i) for i in range(37)] for s, n in zip(seeds, index, strict=True)])
    assert torch.equal(u, ref.to(torch.float32))
    assert bool(((u > 0) & (u < 1)).all())


def test_no_uniform_rounds_to_one():
    """u = 1 would make -log(u) = 0: that token wins the race whatever its logit. With 24 bits the top
    hash value rounded to 1.0 in float32, once per 2**24 tokens (0.8% of steps at a 128k vocabulary)."""
    all_ones = torch.tensor([-1], dtype=torch.int64)  # every one of the 64 bits set
    top = _to_uniform(all_ones).item()
    assert top < 1.0
    assert top == 1.0 - 2.0**-24  # still exact in float32


def test_rng_streams_look_uniform_and_independent():
    u = uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000)
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.002
    corr = torch.corrcoef(u[:8])  # rows from neighbouring seeds
    assert (corr - torch.eye(8)).abs().max().item() < 0.15
    assert not torch.equal(
        uniforms(torch.tensor([5]), torch.tensor([0]), 10), uniforms(torch.tensor([5]), torch.tensor([1]), 10)
    )


def test_greedy_is_argmax():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    out = sample(logits, tensors([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=2.0, top_k=1, seed=s) for s in range(5)]
    assert torch.equal(sample(logits, tensors(params)), logits.argmax(-1))


def reference_allowed(x: list[float], k: int, p: float, m: float) -> set[int]:
    """The filter definition, written out per row in plain Python."""
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    kept = set(order if k <= 0 else [i for i in order if x[i] >= x[order[min(k, len(x)) - 1]]])
    if p < 1.0:
        z = [x[i] for i in order if i in kept]
        norm = sum(math.exp(v - z[0]) for v in z)
        mass, top_p_kept = 0.0, set()
        for i in order:
            if i not in kept:
                continue
            if mass < p or not top_p_kept:
                top_p_kept.add(i)
            mass += math.exp(x[i] - z[0]) / norm
        kept = top_p_kept
    if m > 0.0:
        kept = {i for i in kept if x[i] >= max(x) + math.log(m)}
    return kept


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (20, 0.9, 0.05), (3, 0.3, 0.5)]
)
def test_filters_never_emit_a_filtered_token(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 64, generator=gen) * 2
    params = [SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p) for _ in range(8)]
    x = logits / 0.8
    allowed = [reference_allowed(row, top_k, top_p, min_p) for row in x.tolist()]
    mask = filter_mask(x, tensors(params).top_k, tensors(params).top_p, tensors(params).min_p)
    for r in range(8):
        assert set(torch.nonzero(mask[r]).flatten().tolist()) == allowed[r]
    emitted: list[set[int]] = [set() for _ in range(8)]
    for n in range(100):
        tokens = sample(logits, tensors(params, seeds=list(range(8)), index=[n] * 8)).tolist()
        for r, t in enumerate(tokens):
            assert t in allowed[r], f"row {r} emitted filtered token {t}"
            emitted[r].add(t)
    # It did sample rather than collapse to the argmax (where the filters leave a choice).
    assert sum(len(e) for e in emitted) > 8 or all(len(a) == 1 for a in allowed)


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    vocab = 128
    mine = torch.randn(vocab, generator=gen)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=424242)
    alone = [sample(mine[None], tensors([p], index=[n])).item() for n in range(30)]
    for position in range(4):
        others = torch.randn(3, vocab, generator=gen)
        logits = torch.cat([others[:position], mine[None], others[position:]])
        companions = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=5, seed=1),
            SamplingParams(temperature=1.3, min_p=0.1, seed=2),
        ]
        params = companions[:position] + [p] + companions[position:]
        got = [
            sample(logits, tensors(params, index=[n * 3 + 1] * position + [n] + [n + 5] * (3 - position)))[
                position
            ].item()
            for n in range(30)
        ]
        assert got == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, tensors([SamplingParams(seed=1)], index=[n])).item() for n in range(20)]
    b = [sample(logits, tensors([SamplingParams(seed=2)], index=[n])).item() for n in range(20)]
    assert a != b


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.5, 4)])
def test_temperature_sampling_follows_the_softmax(temperature, top_k):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 6000
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * n
    batch = logits.expand(n, -1)
    tokens = sample(batch, tensors(params, seeds=list(range(10_000, 10_000 + n))))
    empirical = torch.bincount(tokens, minlength=8).double() / n
    x = (logits / temperature).double()
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], -math.inf)
    expected = torch.softmax(x, -1)
    tv = 0.5 * (empirical - expected).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.4f}"
    if top_k:
        assert empirical[expected == 0].sum() == 0


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
def test_top_p_on_a_large_vocab_matches_the_definition(kind):
    """Covers both the candidate shortcut (small nucleus) and the full sort (large nucleus, ties)."""
    gen = torch.Generator().manual_seed(4)
    if kind == "ties":
        x = torch.randint(0, 4, (4, 700), generator=gen).float() * 1.5
    else:
        x = torch.randn(4, 700, generator=gen) * (6.0 if kind == "peaked" else 0.3)
    top_p = torch.tensor([0.5, 0.8, 0.95, 0.99])
    mask = filter_mask(x, torch.zeros(4, dtype=torch.int64), top_p, torch.zeros(4))
    for r in range(4):
        expected = reference_allowed(x[r].tolist(), 0, top_p[r].item(), 0.0)
        assert set(torch.nonzero(mask[r]).flatten().tolist()) == expected


def test_top_k_rows_mixed_with_unfiltered_rows():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    mask = filter_mask(x, torch.tensor([0, 3, 50]), torch.ones(3), torch.zeros(3))
    assert mask[0].all() and mask[2].all()
    assert set(torch.nonzero(mask[1]).flatten().tolist()) == set(x[1].topk(3).indices.tolist())
