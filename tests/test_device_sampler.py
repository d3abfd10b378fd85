"""The device sampler (engine/loop/sampler.py) against the reference sampler (engine/reference/sampler.py).

Without a GPU its Triton kernels run under the interpreter on the CPU. Every test compares, row by
row, state.sampled with engine/sampler.sample() over the same logits and parameters.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from blink_appliance.kernels.sampling import (  # noqa: E402
    SAMPLER_GREEDY,
    SAMPLER_REJECTION,
    SAMPLER_REJECTION_TOP_K,
    SAMPLER_REJECTION_TOP_K_TOP_P,
)

from blink_appliance.engine.loop.sampler import DeviceSampler  # noqa: E402
from blink_appliance.engine.loop.state import DeviceState, LoopGeometry  # noqa: E402
from blink_appliance.engine.reference.sampler import SamplingTensors, sample  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_state(rows: int, vocab: int) -> DeviceState:
    g = LoopGeometry(
        num_slots=rows, max_num_seqs=rows, max_num_batched_tokens=max(rows, 8), buckets=(max(rows, 8),),
        block_size=4, num_kv_blocks=8, max_model_len=16, max_stop_ids=2, vocab_size=vocab, eos_token_ids=(),
    )  # fmt: skip
    return DeviceState.allocate(g, DEVICE)


def load_rows(state: DeviceState, params: list[SamplingParams], output_index: list[int]) -> None:
    """What schedule writes for the sample rows (all rows in use)."""
    n = len(params)
    state.sample_slot[:n] = torch.arange(n, dtype=torch.int32)
    state.row_temperature[:n] = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    state.row_top_k[:n] = torch.tensor([p.top_k for p in params])
    state.row_top_p[:n] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    state.row_min_p[:n] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    state.row_seed[:n] = torch.tensor([p.seed for p in params])
    state.row_output_index[:n] = torch.tensor(output_index)
    state.num_sample_rows.fill_(n)


def reference(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
    st = SamplingTensors.build(params, [p.seed for p in params], output_index, "cpu")
    return sample(logits.cpu(), st)


def variant_for(params: list[SamplingParams]) -> int:
    """The variant schedule picks for these rows (kernels/schedule_batch.py)."""
    need = [
        SAMPLER_GREEDY
        if p.greedy
        else SAMPLER_REJECTION_TOP_K_TOP_P
        if p.top_k > 0 and p.top_p < 1.0
        else SAMPLER_REJECTION_TOP_K
        if p.top_k > 0
        else SAMPLER_REJECTION
        for p in params
    ]
    return max(need)


def run_device(
    logits: torch.Tensor, params, output_index, variant: int | None = None, **options
) -> torch.Tensor:
    """The tokens of `variant` (by default the one schedule picks for these rows)."""
    rows, vocab = logits.shape
    state = make_state(rows, vocab)
    load_rows(state, params, output_index)
    buf = logits.to(DEVICE).contiguous()
    sampler = DeviceSampler(state, buf, **options)
    state.sampler_index.fill_(variant_for(params) if variant is None else variant)
    sampler.run()
    return state.sampled.cpu()


def random_params(gen: torch.Generator, n: int, vocab: int) -> list[SamplingParams]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    out = []
    for _ in range(n):
        out.append(
            SamplingParams(
                temperature=pick([0.0, 0.3, 0.7, 1.0, 1.5]),
                top_k=pick([0, 0, 1, 2, 5, 40, vocab - 1, vocab, vocab + 7]),
                top_p=pick([1.0, 1.0, 0.05, 0.5, 0.9, 0.99]),
                min_p=pick([0.0, 0.0, 0.05, 0.3, 1.0]),
                seed=int(torch.randint(2**62, (1,), generator=gen)),
            )
        )
    return out


@pytest.mark.parametrize("vocab,chunk", [(300, 64), (1000, 256)])
def test_picked_variant_equals_reference_on_random_rows(vocab, chunk):
    gen = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=gen) * 3
    params = random_params(gen, rows, vocab)
    index = torch.randint(0, 500, (rows,), generator=gen).tolist()
    assert variant_for(params) == SAMPLER_REJECTION_TOP_K_TOP_P
    got = run_device(logits, params, index, rejection_chunk=chunk)
    assert torch.equal(got, reference(logits, params, index)), [
        (r, p)
        for r, p in enumerate(params)
        if got[r] != reference(logits[r : r + 1], [p], index[r : r + 1])[0]
    ]


def test_ties_large_top_k_and_large_nuclei():
    """Integer logits (many ties, also at the top-k threshold and the nucleus edge), flat rows (nuclei
    of hundreds of tokens), top_k up to the vocabulary, top_p = 1, min_p in {0, 1}."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 24, 700
    logits = torch.randint(-4, 4, (rows, vocab), generator=gen).float()
    logits[::3] = torch.randn(rows // 3 + (rows % 3 > 0), vocab, generator=gen) * 0.1  # flat: big nuclei
    params = []
    for r in range(rows):
        params.append(
            SamplingParams(
                temperature=[1.0, 0.5, 2.0][r % 3],
                top_k=[0, 3, 100, 450, vocab][r % 5],
                top_p=[0.999, 0.6, 1.0, 0.95][r % 4],
                min_p=[0.0, 1.0, 0.0, 0.02][r % 4 - 1],
                seed=1000 + r,
            )
        )
    index = list(range(rows))
    got = run_device(logits, params, index, rejection_chunk=128)
    assert torch.equal(got, reference(logits, params, index))


def test_greedy_rows_beside_random_ones_and_row_independence():
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 8, 257
    logits = torch.randn(rows, vocab, generator=gen)
    logits[2, [5, 9, 200]] = 10.0  # a tie: lowest index wins
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 0.8, top_p=0.9, seed=r) for r in range(rows)]
    index = [0] * rows
    got = run_device(logits, params, index, rejection_chunk=64)
    assert torch.equal(got, reference(logits, params, index))
    assert got[2] == 5
    # A row's token does not depend on the rows around it: shuffle and compare.
    perm = torch.randperm(rows, generator=gen)
    shuffled = run_device(
        logits[perm], [params[i] for i in perm], [index[i] for i in perm], rejection_chunk=64
    )
    assert torch.equal(shuffled, got[perm])


def test_greedy_variant_is_argmax_with_lowest_index_ties():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 513, generator=gen)
    logits[1, [3, 400]] = 50.0
    state = make_state(6, 513)
    state.num_sample_rows.fill_(6)
    buf = logits.to(DEVICE)
    sampler = DeviceSampler(state, buf)
    state.sampler_index.fill_(SAMPLER_GREEDY)
    sampler.run()
    assert torch.equal(state.sampled.cpu(), logits.argmax(-1))
    assert state.sampled[1].item() == 3


def test_seeded_stream_depends_on_seed_and_output_index_only():
    gen = torch.Generator().manual_seed(9)
    vocab = 400
    logits = torch.randn(1, vocab, generator=gen).expand(6, vocab).contiguous()
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    params = [p, p, p, SamplingParams(temperature=1.0, top_p=0.95, seed=43), p, p]
    index = [0, 0, 1, 0, 2, 0]
    got = run_device(logits, params, index, rejection_chunk=128)
    assert got[0] == got[1] == got[5]
    assert torch.equal(got, reference(logits, params, index))
    draws = {int(run_device(logits[:1], [p], [i])[0]) for i in range(12)}
    assert len(draws) > 1  # the output index moves the stream


def test_rows_past_the_step_are_not_touched():
    """Rows past num_sample_rows (stale logits, NaN here) are neither read nor written."""
    state = make_state(4, 100)
    logits = torch.full((4, 100), float("nan"), device=DEVICE)
    logits[0] = torch.arange(100, dtype=torch.float32)
    load_rows(state, [SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=1)] * 4, [0] * 4)
    state.num_sample_rows.fill_(1)
    state.sampled.fill_(-3)
    sampler = DeviceSampler(state, logits)
    sampler.rejection_top_k_top_p()
    assert 95 <= state.sampled[0].item() <= 99
    assert (state.sampled[1:] == -3).all()


@pytest.mark.slow
def test_larger_vocab_matches_reference():
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 16, 8192
    logits = torch.randn(rows, vocab, generator=gen) * 2
    params = random_params(gen, rows, vocab)
    index = list(range(rows))
    got = run_device(logits, params, index)
    assert torch.equal(got, reference(logits, params, index))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (times the sampler at Llama-3 size)"
)
def test_cost_at_llama3_vocab_and_64_rows(capsys):
    """V = 128256, S = 64: greedy and the picked variant of a random mix (every filter, so top-k with
    top-p too) captured in CUDA graphs and timed, equal to the reference on the same logits; then flat
    top-p rows, which the rejection variant races most often. Prints a table (run with -s); the
    variants' costs per mix are bench/sampler_profile.py's."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 64, 128256
    logits = torch.randn(rows, vocab, generator=gen) * 4
    params = random_params(gen, rows, vocab)
    index = list(range(rows))
    state = make_state(rows, vocab)
    load_rows(state, params, index)
    buf = logits.to(DEVICE)
    sampler = DeviceSampler(state, buf)
    timings = {}
    picked = sampler.variants()[variant_for(params)]
    for name, fn in (("greedy", sampler.greedy), ("picked, a random mix", picked)):
        fn()  # compile, warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / 20 * 1000
    assert torch.equal(state.sampled.cpu(), reference(logits, params, index))  # the last replay: picked
    flat = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in range(rows)]
    load_rows(state, flat, index)
    buf.copy_(torch.randn(rows, vocab, generator=gen).mul_(0.5))
    timings["rejection, flat top_p 0.95"] = _eager_us(sampler.rejection)
    assert torch.equal(state.sampled.cpu(), reference(buf.cpu(), flat, index))
    with capsys.disabled():
        print(f"\nDeviceSampler at V={vocab}, S={rows} ({torch.cuda.get_device_name()}):")
        for name, us in timings.items():
            print(f"  {name:28s} {us:9.1f} us")


def _eager_us(fn) -> float:
    """One warm eager call of `fn`, timed with CUDA events (us)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000


def no_top_k(params: list[SamplingParams]) -> list[SamplingParams]:
    return [dataclasses.replace(p, top_k=0) for p in params]


@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("vocab,chunk", [(300, 64), (1000, 128)])
def test_rejection_variant_equals_reference_without_top_k(vocab, chunk, rounds):
    """Rows with temperature, top-p and min-p (the variant schedule picks when no row uses top-k): the
    race-and-test rounds, and the per-row finisher after them, give the reference's tokens."""
    gen = torch.Generator().manual_seed(vocab + rounds)
    rows = 48
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::4] *= 0.05  # flat rows: the first winner is often outside a small nucleus
    params = no_top_k(random_params(gen, rows, vocab))
    assert variant_for(params) == SAMPLER_REJECTION
    index = torch.randint(0, 500, (rows,), generator=gen).tolist()
    got = run_device(logits, params, index, SAMPLER_REJECTION, rejection_chunk=chunk, rejection_rounds=rounds)
    want = reference(logits, params, index)
    assert torch.equal(got, want), [(r, params[r]) for r in range(rows) if got[r] != want[r]]


def test_rejection_queue_is_reset_for_the_next_step():
    """The rounds run as one launch over a work queue (kernels/sampling_rounds.py); its last program
    out resets the queue, so the next step's rows (other output indices, fewer rows) are sampled
    right and the queue is left empty again. With fewer rows than the grid can keep busy (9 and 1
    rows of 7 chunks, 64 programs) only the busy ones count out."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 16, 400
    logits = (
        torch.randn(rows, vocab, generator=gen) * 0.1
    )  # flat: winners outside the nucleus, so tests queue races
    params = [SamplingParams(temperature=1.0, top_p=[0.3, 0.9, 1.0][r % 3], seed=40 + r) for r in range(rows)]
    state = make_state(rows, vocab)
    sampler = DeviceSampler(state, logits.to(DEVICE), rejection_chunk=64, rejection_rounds=3)
    for step, n in enumerate([rows, 9, 1, rows]):
        index = [step * 7 + r for r in range(n)]
        load_rows(state, params[:n], index)
        sampler.rejection()
        assert torch.equal(state.sampled[:n].cpu(), reference(logits[:n], params[:n], index)), step
        queue = sampler._rejection
        assert n == 1 or (queue.races[:n] > 1).any()  # some rows were raced again inside the launch
        assert (queue.queue == -1).all() and (queue.counters == 0).all()


_COMPILE_ROUNDS_FOR_H100 = """
import torch
from blink_appliance.kernels.sampling_gather import GATHER_CAP
from blink_appliance.kernels.sampling_rounds import _rounds_kernel
from tests.sm90_ptx import ptx_for_sm90
f32, i32, i64 = (torch.zeros(1, dtype=d) for d in (torch.float32, torch.int32, torch.int64))
pointers = dict(
    logits=f32, n_rows=i32, temperature=f32, top_p=f32, top_k=i64, min_p=f32, seed=i64, out_index=i64, sampled=i64,
    status=i32, bound_x=f32, bound_i=i64, candidate=i64, row_max=f32, row_lse=f32, cut=f32, select=i64,
    select_hist=i32, part_score=f32,
    part_index=i64, part_max=f32, part_sum=f32, part_hist=i32, gather=i64, gathered=i32, arrived=i32, races=i32,
    queue=i32, counters=i32,
)
args = {f"{name}_ptr": t for name, t in pointers.items()} | dict(stride=0, V=0, n_chunks=0, queue_size=0)
for top_k, both, gather in ((False, False, 0), (True, False, 0), (True, False, GATHER_CAP), (True, True, GATHER_CAP)):
    constexprs = dict(ROUNDS=3, CHUNK=2048, BLOCK_C=64, GROUP=1, PRECISE=True, SLEEP=True, TOP_K=top_k, BOTH=both,
                      GATHER_CAP=gather)
    ptx = ptx_for_sm90(_rounds_kernel, args, constexprs, num_warps=4, scalar="i32")
    print(ptx.count("nanosleep.u32 1000"), ".acquire." in ptx, ".release." in ptx, ptx.count(".local"))
"""


def test_rounds_kernel_compiles_for_the_h100():
    """The queue kernel's GPU path (the waiting programs' nanosleep, the queue's acquire and release)
    compiles for sm_90 here, without a GPU: the interpreter lets through what the compiler refuses
    (a global that is not a constexpr, say). In a child process, since TRITON_INTERPRET is set here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_ROUNDS_FOR_H100], cwd=Path(__file__).parent.parent, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode and (
        "ptxas" in done.stderr or "No module named 'triton.backends.nvidia" in done.stderr
    ):
        pytest.skip(f"no CUDA compiler backend in this install: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 4, done.stdout
    for line in done.stdout.splitlines():  # without top-k, with it (not gathering, gathering), with both
        sleeps, acquire, release, local = line.split()
        assert int(sleeps) >= 1 and acquire == release == "True" and local == "0", done.stdout


def test_rejection_variant_on_ties_small_nuclei_and_greedy_rows():
    """Integer logits (ties at the nucleus edge), nuclei of a few tokens over flat rows (many rejected
    winners, so the finisher runs), min-p that rejects, argmax rows and unused rows in the same batch."""
    gen = torch.Generator().manual_seed(17)
    rows, vocab = 24, 700
    logits = torch.randint(-4, 4, (rows, vocab), generator=gen).float()
    logits[::3] = torch.randn(rows // 3, vocab, generator=gen) * 0.1
    params = [
        SamplingParams(
            temperature=[1.0, 0.5, 0.0, 2.0][r % 4],
            top_p=[0.999, 0.6, 1.0, 0.95, 0.01][r % 5],
            min_p=[0.0, 1.0, 0.0, 0.02, 0.5][r % 5 - 1],
            seed=2000 + r,
        )
        for r in range(rows)
    ]
    index = list(range(rows))
    got = run_device(logits, params, index, SAMPLER_REJECTION, rejection_chunk=128, rejection_rounds=1)
    assert torch.equal(got, reference(logits, params, index))
    # Rows past num_sample_rows are not the step's: neither variant reads or writes them.
    state = make_state(rows, vocab)
    load_rows(state, params, index)
    state.num_sample_rows.fill_(5)
    state.sampled.fill_(-3)
    sampler = DeviceSampler(state, logits.to(DEVICE), rejection_chunk=128)
    sampler.rejection()
    assert torch.equal(state.sampled[:5].cpu(), reference(logits[:5], params[:5], index[:5]))
    assert (state.sampled[5:] == -3).all()
    sampler.greedy()
    assert torch.equal(state.sampled[:5].cpu(), logits[:5].argmax(-1))
    assert (state.sampled[5:] == -3).all()


def test_variants_are_ordered_by_what_they_serve():
    state = make_state(2, 64)
    sampler = DeviceSampler(state, torch.zeros(2, 64, device=DEVICE))
    assert sampler.variants() == (
        sampler.greedy, sampler.rejection, sampler.rejection_top_k, sampler.rejection_top_k_top_p
    )  # fmt: skip
    assert SAMPLER_GREEDY < SAMPLER_REJECTION < SAMPLER_REJECTION_TOP_K < SAMPLER_REJECTION_TOP_K_TOP_P


def test_with_penalties_and_logprobs_the_variants_are_the_plain_ones_then_each_after():
    from blink_appliance.kernels.sampling import SAMPLER_LOGPROBS, SAMPLER_PENALTIES

    from blink_appliance.engine.loop.penalties import DevicePenalties

    state = make_state(2, 64)
    logits = torch.zeros(2, 64, device=DEVICE)
    sampler = DeviceSampler(state, logits, penalties=DevicePenalties(state, logits))
    variants = sampler.variants()
    assert len(variants) == 2 * SAMPLER_PENALTIES and SAMPLER_PENALTIES == 2 * SAMPLER_LOGPROBS
    # Without a logprob area the logprob indices hold the plain variants (schedule never picks them).
    assert variants[SAMPLER_LOGPROBS:SAMPLER_PENALTIES] == variants[:SAMPLER_LOGPROBS]
